//! Message authentication for strait's packets and discovery messages:
//! HMAC-SHA256 (RFC 2104) from the `hmac` and `sha2` crates, never a home-made
//! construction. Tags that ride in packets are truncated to [`TAG_LEN`] bytes (RFC
//! 2104 section 5 allows any length of at least half the hash; 128 bits leave a
//! forger one chance in 2^128 per attempt).
//!
//! ```
//! use strait_wire::auth::{PacketKey, TAG_LEN};
//! let k = PacketKey::new(b"a key of any length");
//! let tag = k.tag(&[b"header", b"payload"]);
//! assert!(k.verify(&[b"header", b"payload"], &tag[..TAG_LEN]));
//! assert!(!k.verify(&[b"header", b"payloae"], &tag[..TAG_LEN]));
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a truncated tag as carried in a packet or a discovery message.
pub const TAG_LEN: usize = 16;

/// An HMAC-SHA256 key with its inner and outer pads already absorbed: each tag
/// costs a clone of that state and the hashing of the message itself, no key
/// schedule.
#[derive(Clone)]
pub struct PacketKey {
    mac: HmacSha256,
    /// SHA-256 of the key, so keys can be compared (`PartialEq`) without keeping the
    /// key itself around.
    fingerprint: [u8; 32],
}

impl PacketKey {
    /// A key from any number of bytes (HMAC hashes keys longer than a block).
    pub fn new(key: &[u8]) -> PacketKey {
        let mac = match <HmacSha256 as Mac>::new_from_slice(key) {
            Ok(m) => m,
            // `Hmac` takes keys of every length; this arm cannot run.
            Err(_) => unreachable!("HMAC-SHA256 accepts keys of any length"),
        };
        let fingerprint = sha2::Digest::finalize(sha2::Digest::chain_update(Sha256::default(), key)).into();
        PacketKey { mac, fingerprint }
    }

    /// The full 32-byte HMAC-SHA256 of the concatenation of `parts`.
    pub fn tag(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut m = self.mac.clone();
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// True if `tag` (a prefix of the HMAC, at least [`TAG_LEN`] bytes) is the HMAC
    /// of the concatenation of `parts`. Compares in constant time.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        if tag.len() < TAG_LEN {
            return false;
        }
        let mut m = self.mac.clone();
        for p in parts {
            m.update(p);
        }
        m.verify_truncated_left(tag).is_ok()
    }

    /// A key derived from this one for `label` and `context` (the HMAC of both as the
    /// new key: HKDF-Expand's first block with a fixed label, RFC 5869).
    pub fn derive(&self, label: &[u8], context: &[&[u8]]) -> PacketKey {
        let mut parts: Vec<&[u8]> = Vec::with_capacity(context.len() + 2);
        parts.push(label);
        parts.extend_from_slice(context);
        parts.push(&[1u8]);
        PacketKey::new(&self.tag(&parts))
    }
}

impl PartialEq for PacketKey {
    fn eq(&self, other: &Self) -> bool {
        self.fingerprint == other.fingerprint
    }
}

impl Eq for PacketKey {}

impl std::fmt::Debug for PacketKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key, nor enough of its hash to test guesses against.
        write!(f, "PacketKey({:02x}{:02x}..)", self.fingerprint[0], self.fingerprint[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_rfc_4231_test_case_2() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let k = PacketKey::new(b"Jefe");
        let t = k.tag(&[b"what do ya want ", b"for nothing?"]);
        let want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        let got: String = t.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(got, want);
        assert!(k.verify(&[b"what do ya want for nothing?"], &t));
        assert!(k.verify(&[b"what do ya want for nothing?"], &t[..TAG_LEN]));
        assert!(!k.verify(&[b"what do ya want for nothing?"], &t[..TAG_LEN - 1]));
        assert!(!PacketKey::new(b"Jeff").verify(&[b"what do ya want for nothing?"], &t));
    }

    #[test]
    fn derived_keys_differ_by_label_and_context() {
        let k = PacketKey::new(b"secret");
        let a = k.derive(b"x", &[b"1"]);
        assert_eq!(a, k.derive(b"x", &[b"1"]));
        assert_ne!(a, k.derive(b"y", &[b"1"]));
        assert_ne!(a, k.derive(b"x", &[b"2"]));
        assert_ne!(a, k);
        assert!(!format!("{a:?}").contains("secret"));
    }
}
