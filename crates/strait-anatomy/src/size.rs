//! Message sizes: parsing `8,64,4K,1M` lists and printing sizes compactly.
//!
//! Suffixes are binary and case-insensitive: `K`/`KiB` = 1024, `M`/`MiB` = 1024²,
//! `G`/`GiB` = 1024³; a trailing `B` is allowed (`4KB` = `4K` = 4096, `8B` = 8).

use thiserror::Error;

/// A size or size list could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SizeError {
    /// The text is empty.
    #[error("empty size")]
    Empty,
    /// The number part is not a non-negative integer.
    #[error("{0:?} is not a size (expected e.g. 64, 4K, 1M)")]
    Invalid(String),
    /// The suffix is unknown.
    #[error("{0:?} has an unknown unit (use B, K, M or G)")]
    Unit(String),
    /// The value does not fit in 64 bits.
    #[error("{0:?} is too large")]
    Overflow(String),
}

/// Parses one size such as `512`, `4K`, `4KiB`, `1M`, `2G`, `8B`.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(SizeError::Empty);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(SizeError::Invalid(t.to_owned()));
    }
    let n: u64 = num.parse().map_err(|_| SizeError::Overflow(t.to_owned()))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(SizeError::Unit(t.to_owned())),
    };
    n.checked_mul(mult).ok_or_else(|| SizeError::Overflow(t.to_owned()))
}

/// Parses a comma-separated list of sizes (`8,64,4K`); empty items are errors.
pub fn parse_size_list(text: &str) -> Result<Vec<u64>, SizeError> {
    text.split(',').map(parse_size).collect()
}

/// Compact size for flags and tables: `8`, `4K`, `1M`, `1536` (exact, no rounding).
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    for (m, u) in UNITS {
        if bytes >= m && bytes.is_multiple_of(m) {
            return format!("{}{u}", bytes / m);
        }
    }
    bytes.to_string()
}

/// Human size for headings: `8 B`, `4 KiB`, `1 MiB`, `1.5 KiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (m, u) in UNITS {
        if bytes >= m {
            if bytes.is_multiple_of(m) {
                return format!("{} {u}", bytes / m);
            }
            return format!("{:.1} {u}", bytes as f64 / m as f64);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("8B"), Ok(8));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("4kb"), Ok(4096));
        assert_eq!(parse_size(" 1M "), Ok(1 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert!(matches!(parse_size("K"), Err(SizeError::Invalid(_))));
        assert!(matches!(parse_size("-4"), Err(SizeError::Invalid(_))));
        assert!(matches!(parse_size("4X"), Err(SizeError::Unit(_))));
        assert!(matches!(parse_size("1.5K"), Err(SizeError::Unit(_))));
        assert!(matches!(parse_size("99999999999999999999"), Err(SizeError::Overflow(_))));
        assert!(matches!(parse_size("17179869184G"), Err(SizeError::Overflow(_))));
    }

    #[test]
    fn parses_lists() {
        assert_eq!(
            parse_size_list("8,64,512,4K,32K,256K,1M"),
            Ok(vec![8, 64, 512, 4096, 32768, 262144, 1 << 20])
        );
        assert_eq!(parse_size_list("1K"), Ok(vec![1024]));
        assert_eq!(parse_size_list("8,,64"), Err(SizeError::Empty));
    }

    #[test]
    fn formats_round_trip() {
        for s in [0u64, 1, 8, 1000, 1024, 1536, 4096, 65536, 1 << 20, 3 << 20, 1 << 30] {
            assert_eq!(parse_size(&format_size(s)), Ok(s));
        }
        assert_eq!(format_size(4096), "4K");
        assert_eq!(format_size(1536), "1536");
        assert_eq!(human_size(8), "8 B");
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(4 << 20), "4 MiB");
    }
}
