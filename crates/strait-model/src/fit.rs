//! Least squares: a small linear solver, the per-layer line fit `y = g + B·G`, and
//! residual reporting.
//!
//! Fits minimise the sum of squared *relative* residuals `((fit - y) / y)²`: the
//! sizes span three decades, and an absolute fit would let the largest size decide
//! everything.

use serde::{Deserialize, Serialize};

use crate::ModelError;

/// One fitted point: what was measured, what the fit gives, and the relative residual.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Residual {
    /// Message size, bytes.
    pub size_bytes: u64,
    /// Measured value.
    pub measured: f64,
    /// The fit's value at this size.
    pub fitted: f64,
    /// `(fitted - measured) / measured`.
    pub rel: f64,
}

/// Root mean square of the relative residuals (0 for none).
pub fn rms_rel(res: &[Residual]) -> f64 {
    if res.is_empty() {
        return 0.0;
    }
    (res.iter().map(|r| r.rel * r.rel).sum::<f64>() / res.len() as f64).sqrt()
}

/// Solves the weighted least-squares problem `min Σ_k ((x_k·p - y_k) / y_k)²` for
/// `p` (relative residuals; every `y_k` must be positive), by the normal equations
/// with partial pivoting. Columns that are all zero get a zero coefficient.
pub fn least_squares_rel(rows: &[Vec<f64>], y: &[f64]) -> Result<Vec<f64>, ModelError> {
    let n = rows.first().map_or(0, Vec::len);
    if rows.len() != y.len() || rows.iter().any(|r| r.len() != n) {
        return Err(ModelError::Fit("rows and values do not match".into()));
    }
    if let Some(bad) = y.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        return Err(ModelError::Fit(format!("measured value {bad} is not a positive number")));
    }
    if rows.iter().flatten().any(|v| !v.is_finite()) {
        return Err(ModelError::Fit("a regressor is not finite".into()));
    }
    let used: Vec<usize> = (0..n).filter(|&j| rows.iter().any(|r| r[j] != 0.0)).collect();
    let m = used.len();
    if rows.len() < m {
        return Err(ModelError::Fit(format!("{} points cannot determine {m} parameters", rows.len())));
    }
    // Normal equations A^T W A p = A^T W y with W = 1/y², columns scaled to unit
    // size for conditioning.
    let scale: Vec<f64> = used.iter().map(|&j| rows.iter().map(|r| r[j].abs()).fold(0.0, f64::max)).collect();
    let mut a = vec![vec![0.0f64; m + 1]; m];
    for (r, &yk) in rows.iter().zip(y) {
        let w = 1.0 / (yk * yk);
        for (p, &jp) in used.iter().enumerate() {
            let xp = r[jp] / scale[p];
            for (q, &jq) in used.iter().enumerate() {
                a[p][q] += w * xp * r[jq] / scale[q];
            }
            a[p][m] += w * xp * yk;
        }
    }
    let diag = (0..m).map(|i| a[i][i].abs()).fold(0.0, f64::max);
    for col in 0..m {
        let piv = (col..m)
            .max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))
            .ok_or_else(|| ModelError::Fit("empty system".into()))?;
        if a[piv][col].abs().partial_cmp(&(1e-12 * diag)) != Some(std::cmp::Ordering::Greater) {
            return Err(ModelError::Fit(
                "the points do not determine the parameters (collinear regressors)".into(),
            ));
        }
        a.swap(col, piv);
        let pivot_row = a[col].clone();
        for (i, row) in a.iter_mut().enumerate() {
            if i != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row[col..].iter_mut().zip(&pivot_row[col..]) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut p = vec![0.0; n];
    for (i, &j) in used.iter().enumerate() {
        p[j] = a[i][m] / a[i][i] / scale[i];
    }
    Ok(p)
}

/// A fitted line `y = g + B·G` (one layer's costs) with its residuals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LineFit {
    /// Intercept `g`: the per-packet cost, ns.
    pub per_packet_ns: f64,
    /// Slope `G`: the per-byte cost, ns per byte.
    pub per_byte_ns: f64,
    /// Every fitted point.
    pub residuals: Vec<Residual>,
    /// RMS of the relative residuals.
    pub rms_rel: f64,
}

impl LineFit {
    /// `g + B·G`.
    pub fn at(&self, bytes: f64) -> f64 {
        self.per_packet_ns + bytes * self.per_byte_ns
    }
}

/// Fits `y = g + B·G` to `(size, y)` points (relative least squares). One point
/// (or points at a single size) gives a per-packet cost only (`G = 0`). A layer
/// whose values are all zero (it did not occur) fits to zero.
pub fn fit_line(points: &[(u64, f64)]) -> Result<LineFit, ModelError> {
    if points.is_empty() {
        return Err(ModelError::Fit("no points to fit".into()));
    }
    if let Some((s, v)) = points.iter().find(|(_, v)| !v.is_finite() || *v < 0.0) {
        return Err(ModelError::Fit(format!("value {v} at {s} B is not a non-negative number")));
    }
    let positive: Vec<(u64, f64)> = points.iter().copied().filter(|(_, v)| *v > 0.0).collect();
    let (g, big_g) = if positive.is_empty() {
        (0.0, 0.0)
    } else {
        let distinct = positive.iter().any(|p| p.0 != positive[0].0);
        if distinct {
            let rows: Vec<Vec<f64>> = positive.iter().map(|&(s, _)| vec![1.0, s as f64]).collect();
            let y: Vec<f64> = positive.iter().map(|p| p.1).collect();
            let p = least_squares_rel(&rows, &y)?;
            (p[0], p[1])
        } else {
            // Mean in the relative sense: minimises Σ((g - y)/y)².
            let num: f64 = positive.iter().map(|p| 1.0 / p.1).sum();
            let den: f64 = positive.iter().map(|p| 1.0 / (p.1 * p.1)).sum();
            (num / den, 0.0)
        }
    };
    let residuals = residuals(points, |b| g + b as f64 * big_g);
    let rms = rms_rel(&residuals);
    Ok(LineFit { per_packet_ns: g, per_byte_ns: big_g, residuals, rms_rel: rms })
}

/// Residuals of `f` against the points; the relative residual of a zero
/// measurement is 0 if the fit is also ~0, else 1.
pub fn residuals(points: &[(u64, f64)], f: impl Fn(u64) -> f64) -> Vec<Residual> {
    points
        .iter()
        .map(|&(s, y)| {
            let fitted = f(s);
            let rel = if y != 0.0 {
                (fitted - y) / y
            } else if fitted.abs() < 1e-9 {
                0.0
            } else {
                1.0
            };
            Residual { size_bytes: s, measured: y, fitted, rel }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_known_line() {
        let (g, big_g) = (350.0, 0.07);
        let pts: Vec<(u64, f64)> =
            [1u64 << 10, 4 << 10, 16 << 10, 64 << 10].iter().map(|&s| (s, g + big_g * s as f64)).collect();
        let f = fit_line(&pts).unwrap();
        assert!((f.per_packet_ns - g).abs() < 1e-6, "{f:?}");
        assert!((f.per_byte_ns - big_g).abs() < 1e-12, "{f:?}");
        assert!(f.rms_rel < 1e-12);
        assert_eq!(f.residuals.len(), 4);
    }

    #[test]
    fn noisy_line_has_small_residuals_and_reports_them() {
        let (g, big_g) = (1000.0, 0.05);
        // ±3% alternating noise.
        let pts: Vec<(u64, f64)> = (0..10)
            .map(|i| {
                let s = 1024u64 << i;
                let noise = if i % 2 == 0 { 1.03 } else { 0.97 };
                (s, (g + big_g * s as f64) * noise)
            })
            .collect();
        let f = fit_line(&pts).unwrap();
        assert!((f.per_byte_ns - big_g).abs() / big_g < 0.05, "{f:?}");
        assert!(f.rms_rel > 0.01 && f.rms_rel < 0.05, "{f:?}");
    }

    #[test]
    fn three_parameters_recovered() {
        // y = 5 + 2a + 0.5b
        let rows = vec![vec![1.0, 1.0, 10.0], vec![1.0, 3.0, 2.0], vec![1.0, 7.0, 30.0], vec![1.0, 2.0, 5.0]];
        let y: Vec<f64> = rows.iter().map(|r| 5.0 + 2.0 * r[1] + 0.5 * r[2]).collect();
        let p = least_squares_rel(&rows, &y).unwrap();
        for (got, want) in p.iter().zip([5.0, 2.0, 0.5]) {
            assert!((got - want).abs() < 1e-9, "{p:?}");
        }
    }

    #[test]
    fn single_size_and_zero_layers() {
        let f = fit_line(&[(4096, 100.0), (4096, 110.0)]).unwrap();
        assert_eq!(f.per_byte_ns, 0.0);
        assert!(f.per_packet_ns > 100.0 && f.per_packet_ns < 110.0);
        let z = fit_line(&[(4096, 0.0), (8192, 0.0)]).unwrap();
        assert_eq!((z.per_packet_ns, z.per_byte_ns, z.rms_rel), (0.0, 0.0, 0.0));
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(fit_line(&[]).is_err());
        assert!(fit_line(&[(1, f64::NAN)]).is_err());
        assert!(fit_line(&[(1, -3.0)]).is_err());
        assert!(least_squares_rel(&[vec![1.0, 2.0]], &[1.0, 2.0]).is_err());
        assert!(least_squares_rel(&[vec![1.0]], &[0.0]).is_err());
        // Collinear: two identical columns.
        let rows = vec![vec![1.0, 1.0], vec![2.0, 2.0], vec![3.0, 3.0]];
        assert!(least_squares_rel(&rows, &[1.0, 2.0, 3.0]).is_err());
        // Too few points.
        assert!(least_squares_rel(&[vec![1.0, 2.0]], &[1.0]).is_err());
    }
}
