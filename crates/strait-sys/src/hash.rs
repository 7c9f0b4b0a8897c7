//! A hasher for maps keyed by small integers the process makes itself (descriptor
//! numbers, ids, addresses): one multiplication per key instead of SipHash, on paths
//! taken for every message or wait. Not for keys an outsider chooses (no defence
//! against collisions made on purpose).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Multiplicative hashing of integer keys (Fibonacci hashing).
#[derive(Default, Clone, Copy)]
pub struct IntHasher(u64);

const K: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(K);
        }
    }
    fn write_u64(&mut self, n: u64) {
        // The product's high half, which every bit of the key reaches, folded into
        // its low half, and multiplied again: tables index by the low bits and tag by
        // the top ones, and keys that are addresses have their low bits all zero (a
        // multiplication alone keeps them so: every key then starts its probe in one
        // bucket of sixteen, and 2000 epoll members took 7x the kernel's time).
        let x = n.wrapping_mul(K);
        self.0 = (x ^ (x >> 32)).wrapping_mul(K);
    }
    fn write_i32(&mut self, n: i32) {
        self.write_u64(u64::from(n as u32));
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A `HashMap` keyed by integers with [`IntHasher`].
pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearby_keys_spread_over_the_buckets() {
        let mut m: IntMap<i32, i32> = IntMap::default();
        for k in 0..1000 {
            m.insert(k, k * 2);
        }
        assert!((0..1000).all(|k| m[&k] == k * 2));
        let hash = |k: u64| {
            let mut h = IntHasher::default();
            h.write_u64(k);
            h.finish()
        };
        // What a table indexes by (the low bits) and tags with (the top seven) differ
        // for consecutive keys and for addresses of heap objects (aligned: their low
        // bits are zero).
        let strided = |base: u64, step: u64| (0..64u64).map(|i| base + i * step).collect::<Vec<_>>();
        for keys in [
            strided(0, 1),
            strided(0x5555_5a3c_2000, 1024),
            strided(0x7f3e_990a_5000, 4096),
            strided(0x5555_5a3c_2010, 48),
        ] {
            let low: std::collections::HashSet<u64> = keys.iter().map(|&k| hash(k) & 63).collect();
            let top: std::collections::HashSet<u64> = keys.iter().map(|&k| hash(k) >> 57).collect();
            assert!(low.len() > 32 && top.len() > 32, "low {} top {}", low.len(), top.len());
        }
    }
}
