//! Predicted against measured: the cases of `strait model check` and their errors.

use serde::{Deserialize, Serialize};

use crate::data::Metric;

/// One compared value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Case {
    /// Transport name.
    pub path: String,
    /// `fine` or `coarse` for the shm path's runs, absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pipelining: Option<String>,
    /// `latency` (ns, one-way) or `bandwidth` (GB/s).
    pub metric: Metric,
    /// Message size, bytes.
    pub size_bytes: u64,
    /// The model's value.
    pub predicted: f64,
    /// The measured value.
    pub measured: f64,
    /// `|predicted - measured| / measured`.
    pub rel_error: f64,
}

impl Case {
    /// A case with its relative error computed.
    pub fn new(
        path: &str,
        pipelining: Option<&str>,
        metric: Metric,
        size_bytes: u64,
        predicted: f64,
        measured: f64,
    ) -> Case {
        let rel_error =
            if measured != 0.0 { ((predicted - measured) / measured).abs() } else { f64::INFINITY };
        Case {
            path: path.to_owned(),
            pipelining: pipelining.map(str::to_owned),
            metric,
            size_bytes,
            predicted,
            measured,
            rel_error,
        }
    }
}

/// The median error of one path and metric.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Median {
    /// Transport name.
    pub path: String,
    /// `latency` or `bandwidth`.
    pub metric: Metric,
    /// Median of the cases' relative errors.
    pub median_rel_error: f64,
    /// Largest relative error.
    pub max_rel_error: f64,
    /// Number of cases.
    pub cases: usize,
}

/// Median of a list (mean of the middle two for an even count); None if empty.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// Per (path, metric) medians, in first-seen order.
pub fn medians(cases: &[Case]) -> Vec<Median> {
    let mut keys: Vec<(String, Metric)> = Vec::new();
    for c in cases {
        if !keys.iter().any(|k| k.0 == c.path && k.1 == c.metric) {
            keys.push((c.path.clone(), c.metric));
        }
    }
    keys.into_iter()
        .map(|(path, metric)| {
            let errs: Vec<f64> =
                cases.iter().filter(|c| c.path == path && c.metric == metric).map(|c| c.rel_error).collect();
            Median {
                median_rel_error: median(&errs).unwrap_or(f64::NAN),
                max_rel_error: errs.iter().copied().fold(0.0, f64::max),
                cases: errs.len(),
                path,
                metric,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_and_medians() {
        let c = Case::new("p", None, Metric::Latency, 8, 110.0, 100.0);
        assert!((c.rel_error - 0.1).abs() < 1e-12);
        let c2 = Case::new("p", None, Metric::Latency, 16, 90.0, 100.0);
        let c3 = Case::new("p", Some("fine"), Metric::Bandwidth, 16, 3.0, 2.0);
        let m = medians(&[c, c2, c3]);
        assert_eq!(m.len(), 2);
        assert!((m[0].median_rel_error - 0.1).abs() < 1e-12);
        assert_eq!(m[1].cases, 1);
        assert!((m[1].max_rel_error - 0.5).abs() < 1e-12);
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert!(Case::new("p", None, Metric::Latency, 1, 1.0, 0.0).rel_error.is_infinite());
    }

    #[test]
    fn case_json_has_the_issue_fields() {
        let c = Case::new("strait-shm", Some("fine"), Metric::Bandwidth, 4096, 11.0, 10.0);
        let v = serde_json::to_value(&c).unwrap();
        for k in ["path", "metric", "size_bytes", "predicted", "measured", "rel_error"] {
            assert!(v.get(k).is_some(), "{k}");
        }
        assert_eq!(v["metric"], "bandwidth");
    }
}
