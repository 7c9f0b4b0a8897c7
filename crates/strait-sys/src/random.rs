//! Random ids from the kernel's pool (`getrandom`), for connection nonces and
//! incarnation ids.

/// Fills `buf` from `getrandom`; false if the kernel could not (no entropy source).
fn fill(buf: &mut [u8]) -> bool {
    // SAFETY: getrandom writes at most `buf.len()` bytes into the caller's buffer.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    n == buf.len() as isize
}

/// 64 random bits, or `None` if the kernel has no entropy to give. Callers decide
/// whether a guessable fallback is acceptable (an incarnation id) or not (a nonce).
pub fn random_u64() -> Option<u64> {
    let mut b = [0u8; 8];
    fill(&mut b).then(|| u64::from_le_bytes(b))
}

/// 32 random bits, or `None` as for [`random_u64`].
pub fn random_u32() -> Option<u32> {
    let mut b = [0u8; 4];
    fill(&mut b).then(|| u32::from_le_bytes(b))
}

/// Nanoseconds since the Unix epoch (0 if the clock is before it): the seed of the
/// fallbacks used when [`random_u64`] has nothing.
pub fn unix_nanos() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}
