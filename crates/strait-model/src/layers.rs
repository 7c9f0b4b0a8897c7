//! Per-layer fits from `strait anatomy`: every stage of a path is a layer, and its
//! time per size gives that layer's `g_i` and `G_i` (least squares, residuals kept).
//!
//! strait's shm path runs two protocols: eager messages (one frame) and rendezvous
//! ones (a handshake, then the pieces). Their stages differ, so the runs of a path
//! are split into *regimes*: `rendezvous` when a run has `rndv:` stages, `eager`
//! otherwise (the kernel paths are all `eager`: one datagram or segment train).

use serde::{Deserialize, Serialize};

use crate::data::AnatomyRun;
use crate::equations::{coarse_latency, Layer};
use crate::fit::{fit_line, residuals, rms_rel, LineFit, Residual};
use crate::ModelError;

/// One layer's fit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerFit {
    /// Stage name.
    pub name: String,
    /// The fitted line (`per_packet_ns` = g_i, `per_byte_ns` = G_i) and residuals.
    pub fit: LineFit,
}

/// The layers of one path in one regime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegimeFit {
    /// Transport name.
    pub path: String,
    /// `eager` or `rendezvous`.
    pub regime: String,
    /// Sizes the fit saw, bytes.
    pub sizes: Vec<u64>,
    /// The layers in path order.
    pub layers: Vec<LayerFit>,
    /// The coarse sum of the fitted layers (eq. 1) against the one-way latency
    /// measured without probes, per size.
    pub sum_residuals: Vec<Residual>,
    /// RMS of `sum_residuals`.
    pub sum_rms_rel: f64,
}

impl RegimeFit {
    /// The fitted layers as model layers.
    pub fn model_layers(&self) -> Vec<Layer> {
        self.layers
            .iter()
            .map(|l| Layer::new(l.name.clone(), l.fit.per_packet_ns, l.fit.per_byte_ns))
            .collect()
    }
}

fn regime_of(r: &AnatomyRun) -> &'static str {
    if r.stages.iter().any(|(n, _)| n.starts_with("rndv:")) {
        "rendezvous"
    } else {
        "eager"
    }
}

/// Fits every stage of every (path, regime) of an anatomy run as a layer.
pub fn fit_anatomy(runs: &[AnatomyRun]) -> Result<Vec<RegimeFit>, ModelError> {
    let mut groups: Vec<(String, &'static str)> = Vec::new();
    for r in runs {
        let k = (r.path.clone(), regime_of(r));
        if !groups.contains(&k) {
            groups.push(k);
        }
    }
    let mut out = Vec::new();
    for (path, regime) in groups {
        let rs: Vec<&AnatomyRun> = runs.iter().filter(|r| r.path == path && regime_of(r) == regime).collect();
        // Stage names in path order (first seen), a stage absent from a run counts 0 there.
        let mut names: Vec<String> = Vec::new();
        for r in &rs {
            for (n, _) in &r.stages {
                if !names.contains(n) {
                    names.push(n.clone());
                }
            }
        }
        let mut layers = Vec::new();
        for n in &names {
            let pts: Vec<(u64, f64)> = rs
                .iter()
                .map(|r| (r.size_bytes, r.stages.iter().find(|s| &s.0 == n).map_or(0.0, |s| s.1)))
                .collect();
            let fit = fit_line(&pts).map_err(|e| ModelError::Fit(format!("{path} {regime} {n:?}: {e}")))?;
            layers.push(LayerFit { name: n.clone(), fit });
        }
        let model: Vec<Layer> = layers
            .iter()
            .map(|l| Layer::new(l.name.clone(), l.fit.per_packet_ns, l.fit.per_byte_ns))
            .collect();
        let measured: Vec<(u64, f64)> = rs.iter().map(|r| (r.size_bytes, r.measured_one_way_ns)).collect();
        let sum_residuals = residuals(&measured, |b| coarse_latency(&model, b as f64));
        let mut sizes: Vec<u64> = rs.iter().map(|r| r.size_bytes).collect();
        sizes.sort_unstable();
        sizes.dedup();
        out.push(RegimeFit {
            path,
            regime: regime.to_owned(),
            sizes,
            sum_rms_rel: rms_rel(&sum_residuals),
            sum_residuals,
            layers,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(size: u64, rndv: bool) -> AnatomyRun {
        let b = size as f64;
        let mut stages = vec![("post".to_owned(), 10.0), ("copy in".to_owned(), 20.0 + 0.03 * b)];
        if rndv {
            stages.push(("rndv: data movement (pipelined)".to_owned(), 1000.0 + 0.05 * b));
        }
        stages.push(("copy out".to_owned(), 15.0 + 0.02 * b));
        let sum: f64 = stages.iter().map(|s| s.1).sum();
        AnatomyRun { path: "strait-shm".into(), size_bytes: size, measured_one_way_ns: sum, stages }
    }

    #[test]
    fn recovers_layers_per_regime() {
        let runs: Vec<AnatomyRun> =
            [4096u64, 8192, 16384, 65536, 262144, 1 << 20].iter().map(|&s| run(s, s > 32768)).collect();
        let f = fit_anatomy(&runs).unwrap();
        assert_eq!(f.len(), 2);
        assert_eq!(f[0].regime, "eager");
        assert_eq!(f[1].regime, "rendezvous");
        assert_eq!(f[1].layers.len(), 4);
        let copy_in = &f[0].layers[1].fit;
        assert!((copy_in.per_packet_ns - 20.0).abs() < 1e-6 && (copy_in.per_byte_ns - 0.03).abs() < 1e-12);
        let dm = &f[1].layers[2].fit;
        assert!((dm.per_packet_ns - 1000.0).abs() < 1e-6 && (dm.per_byte_ns - 0.05).abs() < 1e-12);
        assert!(f[1].sum_rms_rel < 1e-9);
        assert_eq!(f[0].model_layers().len(), 3);
    }
}
