//! Fit on some sizes, predict the others, compare: the core of `strait model check`.
//!
//! The measurements of one check are `strait bench` runs (interleaved rounds,
//! medians per size) over two disjoint size sets: *fit sizes* and *check sizes*.
//! Every parameter is fitted on the fit sizes only; the cases compare the
//! predictions at the check sizes with what was measured there.

use serde::{Deserialize, Serialize};

use crate::check::{median, medians, Case, Median};
use crate::data::{Metric, Point};
use crate::paths::{DatagramModel, LumpedModel, ShmGeometry, ShmModel};
use crate::ModelError;

/// The transport name of strait's shm path.
pub const SHM: &str = "strait-shm";
/// The transport name of the kernel's UDP path.
pub const UDP: &str = "kernel-udp";

/// Every path's fitted model.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FittedModel {
    /// strait's shm path, if measured.
    pub shm: Option<ShmModel>,
    /// The geometries the shm runs had (the first is the default for predictions).
    pub shm_geometries: Vec<ShmGeometry>,
    /// The kernel's UDP path, if measured.
    pub udp: Option<DatagramModel>,
    /// Other paths, end to end.
    pub lumped: Vec<(String, LumpedModel)>,
}

impl FittedModel {
    /// Fits every path: `shm` runs with their geometries, `other` points of any
    /// other transport; only sizes passing `use_size`.
    pub fn fit(
        shm: &[(ShmGeometry, Vec<Point>)],
        other: &[Point],
        use_size: impl Fn(u64) -> bool + Copy,
    ) -> Result<FittedModel, ModelError> {
        let mut m = FittedModel::default();
        let shm: Vec<(ShmGeometry, Vec<Point>)> = shm
            .iter()
            .map(|(g, p)| (*g, p.iter().filter(|x| x.path == SHM).cloned().collect()))
            .filter(|(_, p): &(ShmGeometry, Vec<Point>)| !p.is_empty())
            .collect();
        if !shm.is_empty() {
            m.shm = Some(ShmModel::fit(&shm, use_size)?);
            m.shm_geometries = shm.iter().map(|r| r.0).collect();
        }
        let mut names: Vec<&str> = Vec::new();
        for p in other {
            if p.path != SHM && !names.contains(&p.path.as_str()) {
                names.push(&p.path);
            }
        }
        for n in names {
            let pts: Vec<Point> = other.iter().filter(|p| p.path == n).cloned().collect();
            if n == UDP {
                m.udp = Some(
                    DatagramModel::fit(&pts, use_size).map_err(|e| ModelError::Fit(format!("{n}: {e}")))?,
                );
            } else {
                m.lumped.push((
                    n.to_owned(),
                    LumpedModel::fit(&pts, use_size).map_err(|e| ModelError::Fit(format!("{n}: {e}")))?,
                ));
            }
        }
        if m.shm.is_none() && m.udp.is_none() && m.lumped.is_empty() {
            return Err(ModelError::Fit("no measurements to fit".into()));
        }
        Ok(m)
    }

    /// The prediction for a path (under `geo` for the shm path; the first fitted
    /// geometry if None).
    pub fn predict(&self, path: &str, geo: Option<&ShmGeometry>, metric: Metric, bytes: u64) -> Option<f64> {
        if path == SHM {
            let m = self.shm.as_ref()?;
            let g = geo.or(self.shm_geometries.first())?;
            return match metric {
                Metric::Latency => m.latency(g, bytes),
                Metric::Bandwidth => m.bandwidth(g, bytes),
            };
        }
        if path == UDP {
            return self.udp.as_ref()?.predict(metric, bytes);
        }
        self.lumped.iter().find(|(n, _)| n == path)?.1.predict(metric, bytes)
    }

    /// Compares predictions with the measured points at sizes passing `check_size`.
    pub fn compare(
        &self,
        shm: &[(ShmGeometry, Vec<Point>)],
        other: &[Point],
        check_size: impl Fn(u64) -> bool,
    ) -> Vec<Case> {
        let mut cases = Vec::new();
        for (g, pts) in shm {
            for p in pts.iter().filter(|p| p.path == SHM && check_size(p.size_bytes)) {
                if let Some(v) = self.predict(SHM, Some(g), p.metric, p.size_bytes) {
                    cases.push(Case::new(SHM, Some(g.pipelining()), p.metric, p.size_bytes, v, p.value));
                }
            }
        }
        for p in other.iter().filter(|p| p.path != SHM && check_size(p.size_bytes)) {
            if let Some(v) = self.predict(&p.path, None, p.metric, p.size_bytes) {
                cases.push(Case::new(&p.path, None, p.metric, p.size_bytes, v, p.value));
            }
        }
        cases
    }
}

/// What `strait model check --format json` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckReport {
    /// Every compared value.
    pub cases: Vec<Case>,
    /// Median relative error over all cases.
    pub median_rel_error: f64,
    /// Median relative error per path and metric.
    pub medians: Vec<Median>,
    /// Sizes the parameters were fitted on, bytes.
    pub fit_sizes: Vec<u64>,
    /// Sizes the predictions were checked at, bytes.
    pub check_sizes: Vec<u64>,
    /// The fitted model (parameters and fit residuals).
    pub model: FittedModel,
    /// The command that reproduces the check.
    pub command: String,
    /// Measuring runs found disturbed (other work took CPU time meanwhile, or far from
    /// the other rounds): measured again, or kept when too few others remained.
    #[serde(default)]
    pub disturbed_runs: usize,
    /// Anything worth knowing about the run.
    pub notes: Vec<String>,
}

impl CheckReport {
    /// Fits on `fit_sizes`, checks at `check_sizes` (which must not overlap).
    pub fn run(
        shm: &[(ShmGeometry, Vec<Point>)],
        other: &[Point],
        fit_sizes: &[u64],
        check_sizes: &[u64],
        command: String,
    ) -> Result<CheckReport, ModelError> {
        if let Some(s) = fit_sizes.iter().find(|s| check_sizes.contains(s)) {
            return Err(ModelError::Input(format!(
                "size {s} is both a fit and a check size: the check would not be independent of the fit"
            )));
        }
        let model = FittedModel::fit(shm, other, |b| fit_sizes.contains(&b))?;
        let cases = model.compare(shm, other, |b| check_sizes.contains(&b));
        if cases.is_empty() {
            return Err(ModelError::Input("nothing measured at the check sizes".into()));
        }
        let errs: Vec<f64> = cases.iter().map(|c| c.rel_error).collect();
        Ok(CheckReport {
            median_rel_error: median(&errs).unwrap_or(f64::NAN),
            medians: medians(&cases),
            fit_sizes: fit_sizes.to_vec(),
            check_sizes: check_sizes.to_vec(),
            cases,
            model,
            command,
            disturbed_runs: 0,
            notes: Vec::new(),
        })
    }

    /// The median error of one path and metric, if it has cases.
    pub fn median_of(&self, path: &str, metric: Metric) -> Option<f64> {
        self.medians.iter().find(|m| m.path == path && m.metric == metric).map(|m| m.median_rel_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synthetic(g: &ShmGeometry, sizes: &[u64]) -> Vec<Point> {
        sizes
            .iter()
            .flat_map(|&b| {
                let x = b as f64;
                let lat = if g.is_eager(b) {
                    300.0 + 0.06 * x
                } else {
                    let p = g.pieces(b);
                    // two copies of 0.04 and 0.05 ns/B, 300 ns per piece, 1.5 us handshake
                    let l = [crate::Layer::new("in", 150.0, 0.04), crate::Layer::new("out", 150.0, 0.05)];
                    1500.0 + crate::equations::pipelined_latency(&l, &p)
                };
                vec![
                    Point { path: SHM.into(), metric: Metric::Latency, size_bytes: b, value: lat },
                    Point {
                        path: SHM.into(),
                        metric: Metric::Bandwidth,
                        size_bytes: b,
                        value: x / (150.0 + 0.06 * x),
                    },
                    Point {
                        path: UDP.into(),
                        metric: Metric::Bandwidth,
                        size_bytes: b,
                        value: x / (4000.0 + 0.2 * x),
                    },
                ]
            })
            .collect()
    }

    #[test]
    fn check_on_synthetic_data_is_exact_and_not_circular() {
        let fit: Vec<u64> = (10..=21).map(|e| 3u64 << e).collect();
        let chk: Vec<u64> = (12..=22).map(|e| 1u64 << e).collect();
        let all: Vec<u64> = fit.iter().chain(&chk).copied().collect();
        let fine = ShmGeometry::default();
        let coarse = ShmGeometry { pipeline_threshold: crate::paths::COARSE_THRESHOLD, ..fine };
        let runs = vec![(fine, synthetic(&fine, &all)), (coarse, synthetic(&coarse, &all))];
        let other = synthetic(&fine, &all);
        let r = CheckReport::run(&runs, &other, &fit, &chk, "test".into()).unwrap();
        assert!(r.median_rel_error < 0.01, "{:?}", r.medians);
        assert!(r.median_of(SHM, Metric::Latency).unwrap() < 0.01);
        assert!(r.median_of(UDP, Metric::Bandwidth).is_some());
        assert!(r.cases.iter().all(|c| chk.contains(&c.size_bytes)));
        // Overlapping size sets are refused.
        assert!(CheckReport::run(&runs, &other, &fit, &fit, "x".into()).is_err());
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["cases"].as_array().is_some_and(|c| !c.is_empty()));
        assert!(json["median_rel_error"].as_f64().is_some());
    }
}
