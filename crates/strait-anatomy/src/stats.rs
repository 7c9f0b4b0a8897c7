//! Percentiles of per-iteration samples.
//!
//! Percentiles use linear interpolation between the two closest ranks of the sorted
//! samples (the definition of NumPy's default and of R's type 7): for `n` samples and
//! percentile `p`, the position is `h = (n - 1) * p / 100`, and the value is
//! `x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])`. So the median
//! of an even count is the mean of the middle two, p0 is the minimum and p100 the
//! maximum.

/// Summary of a set of samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

/// The `p`-th percentile (0..=100) of samples that are already sorted ascending;
/// `None` for no samples.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let p = p.clamp(0.0, 100.0);
    let h = (sorted.len() - 1) as f64 * p / 100.0;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    Some(sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo]))
}

/// Sorts `samples` in place (NaNs last) and summarises them; `None` if empty.
pub fn summarize(samples: &mut [f64]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_unstable_by(|a, b| a.total_cmp(b));
    let pct = |p| percentile_sorted(samples, p).unwrap_or(f64::NAN);
    Some(Summary {
        count: samples.len(),
        p50: pct(50.0),
        p99: pct(99.0),
        p999: pct(99.9),
        min: samples[0],
        max: samples[samples.len() - 1],
        mean: samples.iter().sum::<f64>() / samples.len() as f64,
    })
}

/// Median of a small set (sorted in place); `None` if empty.
pub fn median(samples: &mut [f64]) -> Option<f64> {
    summarize(samples).map(|s| s.p50)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let s: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile_sorted(&s, 0.0), Some(1.0));
        assert_eq!(percentile_sorted(&s, 100.0), Some(10.0));
        assert_eq!(percentile_sorted(&s, 50.0), Some(5.5));
        // h = 9 * 0.99 = 8.91 -> 9 + 0.91 * (10 - 9)
        assert!((percentile_sorted(&s, 99.0).unwrap() - 9.91).abs() < 1e-9);
        assert!((percentile_sorted(&s, 25.0).unwrap() - 3.25).abs() < 1e-9);
    }

    #[test]
    fn edge_cases() {
        assert_eq!(percentile_sorted(&[], 50.0), None);
        assert_eq!(percentile_sorted(&[7.0], 99.9), Some(7.0));
        assert_eq!(percentile_sorted(&[1.0, 3.0], 50.0), Some(2.0));
        assert_eq!(percentile_sorted(&[1.0, 3.0], 150.0), Some(3.0));
        assert!(summarize(&mut []).is_none());
    }

    #[test]
    fn summary_of_unsorted_samples() {
        // 1000 samples 0..999 shuffled deterministically, plus one outlier.
        let mut v: Vec<f64> = (0..1000).map(|i| ((i * 7919) % 1000) as f64).collect();
        v.push(1e6);
        let s = summarize(&mut v).unwrap();
        assert_eq!(s.count, 1001);
        assert_eq!(s.p50, 500.0);
        assert_eq!(s.min, 0.0);
        assert_eq!(s.max, 1e6);
        // h = 1000 * 0.99 = 990 -> sorted[990] = 990
        assert!((s.p99 - 990.0).abs() < 1e-9);
        // h = 1000 * 0.999 = 999 -> sorted[999] = 999
        assert!((s.p999 - 999.0).abs() < 1e-6);
        assert!(s.p50 <= s.p99 && s.p99 <= s.p999 && s.p999 <= s.max);
    }

    #[test]
    fn median_of_even_count() {
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }
}
