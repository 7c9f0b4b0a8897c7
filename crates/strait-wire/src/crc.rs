//! CRC32C (Castagnoli, the iSCSI polynomial) in one pass.
//!
//! On x86-64 with SSE4.2 and PCLMULQDQ the buffer is cut into three equal lanes
//! that run through the `crc32` instruction side by side (the instruction has a
//! latency of three cycles and a throughput of one, so one lane alone runs at a
//! third of the speed), and the three lane values are joined with two carry-less
//! multiplications by `x^(8n) mod P`, read from a table built at compile time. The
//! whole length runs three-wide, not just the leading multiples of a fixed block as
//! in the `crc32c` crate, whose tail of up to 767 bytes runs one word at a time:
//! a 1,400-byte payload is 58 three-wide steps here against 32 three-wide and 79
//! one-wide there. Elsewhere the `crc32c` crate computes the same function.

/// The reflected CRC32C polynomial.
const POLY: u32 = 0x82F6_3B78;

/// The longest lane, in 8-byte words (a longer buffer runs as several rounds).
const LANE_MAX_WORDS: usize = 256;

/// The shortest lane worth the join (two multiplications), in 8-byte words.
const LANE_MIN_WORDS: usize = 4;

/// `XN[k] = x^(64k - 33) mod P` (reflected: bit 31 is `x^0`) for `k` in
/// `1..=2 * LANE_MAX_WORDS`; `XN[0]` is unused. Multiplying a CRC register by
/// `XN[k]` and reducing with the `crc32` instruction (which multiplies by `x^32`
/// more and folds 64 bits) advances it over `8k` zero bytes.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
static XN: [u32; 2 * LANE_MAX_WORDS + 1] = xn_table();

const fn xn_table() -> [u32; 2 * LANE_MAX_WORDS + 1] {
    let mut t = [0u32; 2 * LANE_MAX_WORDS + 1];
    // x^31: bit 31 is x^0, so x^31 is bit 0.
    let mut acc: u32 = 1;
    t[1] = acc;
    let mut k = 2;
    while k <= 2 * LANE_MAX_WORDS {
        let mut i = 0;
        while i < 64 {
            acc = if acc & 1 != 0 { (acc >> 1) ^ POLY } else { acc >> 1 };
            i += 1;
        }
        t[k] = acc;
        k += 1;
    }
    t
}

/// Continues a CRC32C: `crc` is the value over what came before (0 for nothing),
/// the result is the value over that and `data`. The same function as
/// `crc32c::crc32c_append`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    !update(!crc, data)
}

/// The CRC32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// Advances the raw CRC register `state` (pre- and post-inversion left to the
/// caller) over `data`.
pub(crate) fn update(state: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if hw::available() {
            // SAFETY: the CPU has SSE4.2 and PCLMULQDQ (checked just above), the
            // only requirement of the target-feature function.
            return unsafe { hw::update(state, data) };
        }
    }
    !crc32c::crc32c_append(!state, data)
}

#[cfg(target_arch = "x86_64")]
mod hw {
    use super::{LANE_MAX_WORDS, LANE_MIN_WORDS, XN};
    use core::arch::x86_64::{
        _mm_clmulepi64_si128, _mm_crc32_u64, _mm_crc32_u8, _mm_cvtsi128_si64, _mm_cvtsi64_si128,
    };

    /// Whether the hardware path runs on this CPU (the standard library caches the
    /// answer).
    pub(super) fn available() -> bool {
        std::is_x86_feature_detected!("sse4.2") && std::is_x86_feature_detected!("pclmulqdq")
    }

    fn word(b: &[u8]) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[..8]);
        u64::from_le_bytes(w)
    }

    /// Advances `crc` (a raw register) over `words` 8-byte words of zeros.
    #[target_feature(enable = "sse4.2,pclmulqdq")]
    fn shift(crc: u32, words: usize) -> u32 {
        let a = _mm_cvtsi64_si128(i64::from(crc));
        let b = _mm_cvtsi64_si128(i64::from(XN[words]));
        let p = _mm_cvtsi128_si64(_mm_clmulepi64_si128::<0>(a, b)) as u64;
        _mm_crc32_u64(0, p) as u32
    }

    #[target_feature(enable = "sse4.2,pclmulqdq")]
    pub(super) fn update(mut state: u32, mut data: &[u8]) -> u32 {
        while data.len() >= 3 * 8 * LANE_MIN_WORDS {
            let words = (data.len() / 24).min(LANE_MAX_WORDS);
            let lane = words * 8;
            let (a, rest) = data.split_at(lane);
            let (b, rest) = rest.split_at(lane);
            let (c, rest) = rest.split_at(lane);
            let (mut x, mut y, mut z) = (u64::from(state), 0u64, 0u64);
            for ((wa, wb), wc) in a.chunks_exact(8).zip(b.chunks_exact(8)).zip(c.chunks_exact(8)) {
                x = _mm_crc32_u64(x, word(wa));
                y = _mm_crc32_u64(y, word(wb));
                z = _mm_crc32_u64(z, word(wc));
            }
            state = shift(x as u32, 2 * words) ^ shift(y as u32, words) ^ z as u32;
            data = rest;
        }
        let mut s = u64::from(state);
        let mut words = data.chunks_exact(8);
        for w in &mut words {
            s = _mm_crc32_u64(s, word(w));
        }
        let mut s = s as u32;
        for &byte in words.remainder() {
            s = _mm_crc32_u8(s, byte);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit-at-a-time CRC32C, the definition.
    fn reference(crc: u32, data: &[u8]) -> u32 {
        let mut s = !crc;
        for &b in data {
            s ^= u32::from(b);
            for _ in 0..8 {
                s = if s & 1 != 0 { (s >> 1) ^ POLY } else { s >> 1 };
            }
        }
        !s
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn known_answer() {
        // The CRC32C check value (RFC 3720 B.4 and the Rocksoft catalogue).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn matches_reference_on_many_lengths_and_alignments() {
        let buf = bytes(20_000 + 16, 0x5eed);
        let mut lengths: Vec<usize> = (0..=800).collect();
        lengths.extend((801..4_000).step_by(7));
        lengths.extend([1_424, 1_472, 6_143, 6_144, 6_145, 8_952, 12_289, 20_000]);
        for &len in &lengths {
            for align in 0..8 {
                let d = &buf[align..align + len];
                let want = reference(0, d);
                assert_eq!(crc32c(d), want, "len {len} align {align}");
                assert_eq!(crc32c::crc32c(d), want, "crate, len {len} align {align}");
                let init = len as u32 * 0x9E37_79B9;
                assert_eq!(crc32c_append(init, d), reference(init, d), "append len {len}");
            }
        }
    }

    #[test]
    fn append_splits_anywhere() {
        let buf = bytes(3_000, 42);
        let whole = reference(0, &buf);
        for cut in (0..buf.len()).step_by(37) {
            assert_eq!(crc32c_append(crc32c(&buf[..cut]), &buf[cut..]), whole, "cut {cut}");
        }
    }

    #[test]
    fn every_single_bit_flip_changes_it() {
        let buf = bytes(1_472, 7);
        let good = crc32c(&buf);
        let mut b = buf.clone();
        for i in 0..b.len() * 8 {
            b[i / 8] ^= 1 << (i % 8);
            assert_ne!(crc32c(&b), good, "bit {i}");
            b[i / 8] ^= 1 << (i % 8);
        }
    }
}
