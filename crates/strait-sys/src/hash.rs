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
        self.0 = (n ^ (n >> 29)).wrapping_mul(K);
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
        // The low bits (what a table indexes by) differ for consecutive keys.
        let low = |k: u64| {
            let mut h = IntHasher::default();
            h.write_u64(k);
            h.finish() >> 57
        };
        let distinct: std::collections::HashSet<u64> = (0..64).map(low).collect();
        assert!(distinct.len() > 32, "{}", distinct.len());
    }
}
