//! Models of the paths strait measures, fitted to measurements:
//!
//! * [`ShmModel`]: strait's shared-memory path. Eager messages (up to the eager
//!   threshold) cross the path as one frame: a coarse-grained path whose layers
//!   (post, copy into the ring, transfer, match, copy out, completion) add up to one
//!   line `g + B·G`. Rendezvous messages pay a fixed handshake (RTS, CTS,
//!   completion) and then move their bytes in pieces through two per-byte layers,
//!   the sender's copy into the ring and the receiver's copy out of it, each with
//!   a per-piece cost: [`pipelined_latency`] of those layers over the pieces the
//!   engine cuts ([`ShmGeometry::pieces`]). The pipelining threshold decides the
//!   pieces: below it a message moves as one piece (as far as the ring allows:
//!   coarse-grained), above it in `chunk_size` pieces (fine-grained).
//! * [`DatagramModel`]: the kernel's UDP path: one datagram per ping-pong message
//!   (a line in `B`); a streamed message is cut into datagrams of at most 65507
//!   bytes, each with its own per-packet cost.
//! * [`LumpedModel`]: any other path, end to end: one line for the latency, one
//!   bottleneck line for the streaming time per message.
//!
//! In every model the streaming bandwidth is `B / (g_b + B·G_b)` of a bottleneck
//! layer fitted to streaming measurements (eq. 2/4: the same for fine and coarse
//! pipelining).

use serde::{Deserialize, Serialize};

use crate::data::{Metric, Point};
use crate::equations::{pieces, pipelined_latency, Layer};
use crate::fit::{fit_line, least_squares_rel, residuals, rms_rel, LineFit, Residual};
use crate::ModelError;

/// Default `STRAIT_EAGER_THRESHOLD`.
pub const DEFAULT_EAGER_THRESHOLD: u64 = 32768;
/// Default `STRAIT_PIPELINE_THRESHOLD`.
pub const DEFAULT_PIPELINE_THRESHOLD: u64 = 65536;
/// Default `STRAIT_CHUNK_SIZE`.
pub const DEFAULT_CHUNK_SIZE: u64 = 131072;
/// Default `STRAIT_SHM_RING_SIZE`.
pub const DEFAULT_RING_SIZE: u64 = 1 << 20;
/// Bytes of the shm ring's frame header (strait-shm `FRAME_HDR`).
const RING_FRAME_HDR: u64 = 8;
/// Largest protocol header (strait-wire `MAX_HEADER_LEN`).
const WIRE_MAX_HEADER: u64 = 40;
/// Pipelining thresholds at or above this are "coarse" (no message is chunked).
pub const COARSE_THRESHOLD: u64 = 1 << 30;
/// Largest UDP payload over IPv4.
pub const UDP_MAX_PAYLOAD: u64 = 65507;

/// Parses a size with an optional binary k/M/G suffix (as `STRAIT_*` variables).
pub fn parse_size(text: &str) -> Result<u64, ModelError> {
    let t = text.trim();
    let (num, mult) = match t.as_bytes().last() {
        Some(b'k' | b'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some(b'm' | b'M') => (&t[..t.len() - 1], 1 << 20),
        Some(b'g' | b'G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.trim().parse::<u64>().ok().and_then(|n| n.checked_mul(mult)).ok_or_else(|| {
        ModelError::Input(format!("{text:?} is not a size (an integer, k/M/G suffix allowed)"))
    })
}

/// The engine and device settings that decide how a message crosses the shm path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmGeometry {
    /// Messages up to this many bytes travel eagerly (one frame).
    pub eager_threshold: u64,
    /// Rendezvous messages at least this long move in `chunk_size` pieces.
    pub pipeline_threshold: u64,
    /// The pipelining chunk, bytes (already capped by the largest piece).
    pub chunk_size: u64,
    /// The largest piece one ring frame carries, bytes.
    pub max_piece: u64,
}

impl Default for ShmGeometry {
    fn default() -> Self {
        ShmGeometry::new(
            DEFAULT_EAGER_THRESHOLD,
            DEFAULT_PIPELINE_THRESHOLD,
            DEFAULT_CHUNK_SIZE,
            DEFAULT_RING_SIZE,
        )
    }
}

impl ShmGeometry {
    /// The geometry of these settings (`ring_size`: bytes of one direction's ring),
    /// capped as the engine caps them.
    pub fn new(
        eager_threshold: u64,
        pipeline_threshold: u64,
        chunk_size: u64,
        ring_size: u64,
    ) -> ShmGeometry {
        let max_piece = (ring_size / 4).saturating_sub(RING_FRAME_HDR + WIRE_MAX_HEADER).max(1);
        ShmGeometry {
            eager_threshold: eager_threshold.min(max_piece),
            pipeline_threshold,
            chunk_size: chunk_size.clamp(1, max_piece),
            max_piece,
        }
    }

    /// The geometry a run had, from its `STRAIT_*` variables (defaults for unset ones).
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<ShmGeometry, ModelError> {
        let num = |k: &str, d: u64| get(k).map_or(Ok(d), |v| parse_size(&v));
        if let Some(m) = get("STRAIT_RNDV_MODE") {
            if matches!(m.trim(), "remote-read" | "cma") {
                return Err(ModelError::Input(
                    "STRAIT_RNDV_MODE=remote-read: the shm model covers the pipelined copy mode only".into(),
                ));
            }
        }
        Ok(ShmGeometry::new(
            num("STRAIT_EAGER_THRESHOLD", DEFAULT_EAGER_THRESHOLD)?,
            num("STRAIT_PIPELINE_THRESHOLD", DEFAULT_PIPELINE_THRESHOLD)?,
            num("STRAIT_CHUNK_SIZE", DEFAULT_CHUNK_SIZE)?,
            num("STRAIT_SHM_RING_SIZE", DEFAULT_RING_SIZE)?,
        ))
    }

    /// `fine` (rendezvous messages from the threshold on are chunked) or `coarse`.
    pub fn pipelining(&self) -> &'static str {
        if self.pipeline_threshold >= COARSE_THRESHOLD {
            "coarse"
        } else {
            "fine"
        }
    }

    /// True if a `bytes`-byte message is sent eagerly.
    pub fn is_eager(&self, bytes: u64) -> bool {
        bytes <= self.eager_threshold
    }

    /// The pieces a rendezvous message of `bytes` moves in.
    pub fn pieces(&self, bytes: u64) -> Vec<u64> {
        let piece =
            if bytes >= self.pipeline_threshold { self.chunk_size } else { bytes.min(self.max_piece) };
        pieces(bytes, piece.max(1))
    }
}

/// The rendezvous part of the shm latency model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RndvFit {
    /// Fixed cost of a rendezvous message (RTS, CTS, completion), ns.
    pub fixed_ns: f64,
    /// Per-piece cost (frame header, commit, poll), ns, split evenly between the two
    /// copy layers.
    pub per_piece_ns: f64,
    /// Per-byte cost of both copies together, ns per byte.
    pub per_byte_ns: f64,
    /// Share of `per_byte_ns` in the sender's copy into the ring (the rest is the
    /// receiver's copy out). The model is (nearly) symmetric in which side is the
    /// slower, so read `max(share, 1 - share)` as the bottleneck copy's share.
    pub copy_in_share: f64,
    /// Fitted points (`pipelining` label of the run, residual).
    pub residuals: Vec<(String, Residual)>,
    /// RMS of the relative residuals.
    pub rms_rel: f64,
}

impl RndvFit {
    /// The layers: fixed handshake, copy into the ring, copy out of the ring.
    pub fn layers(&self) -> Vec<Layer> {
        vec![
            Layer::new("rndv handshake (RTS, CTS, completion)", self.fixed_ns, 0.0),
            Layer::new(
                "copy into ring (sender)",
                self.per_piece_ns / 2.0,
                self.per_byte_ns * self.copy_in_share,
            ),
            Layer::new(
                "copy out of ring (receiver)",
                self.per_piece_ns / 2.0,
                self.per_byte_ns * (1.0 - self.copy_in_share),
            ),
        ]
    }

    /// Per-byte cost of the slower copy, ns per byte: the bottleneck of a long
    /// stream by eq. 2/4 (its bandwidth limit is the inverse, GB/s).
    pub fn bottleneck_per_byte_ns(&self) -> f64 {
        self.per_byte_ns * self.copy_in_share.max(1.0 - self.copy_in_share)
    }

    /// One-way latency of a `bytes`-byte rendezvous message under `geo`, ns.
    pub fn latency(&self, geo: &ShmGeometry, bytes: u64) -> f64 {
        let l = self.layers();
        l[0].per_packet_ns + pipelined_latency(&l[1..], &geo.pieces(bytes))
    }
}

/// The streaming model of one regime: the bottleneck layer's line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandwidthFit {
    /// Which runs it was fitted to (`fine`, `coarse`, or a transport's name).
    pub label: String,
    /// Eager messages' bottleneck (time per message), absent if none was measured.
    pub eager: Option<LineFit>,
    /// Rendezvous messages' bottleneck, absent if none was measured.
    pub rndv: Option<LineFit>,
}

/// The fitted model of strait's shm path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShmModel {
    /// Eager one-way latency, the whole path lumped into one line.
    pub eager: LineFit,
    /// Rendezvous one-way latency.
    pub rndv: Option<RndvFit>,
    /// Bandwidth per geometry it was measured with.
    pub bandwidth: Vec<(ShmGeometry, BandwidthFit)>,
}

/// Grid of the copy-in share tried by the rendezvous fit.
const SHARE_STEPS: usize = 100;

fn fit_rndv(points: &[(ShmGeometry, u64, f64)]) -> Result<RndvFit, ModelError> {
    if points.len() < 3 {
        return Err(ModelError::Fit(format!(
            "rendezvous latency needs at least 3 sizes to fit, got {}",
            points.len()
        )));
    }
    let y: Vec<f64> = points.iter().map(|p| p.2).collect();
    let mut best: Option<(f64, f64, Vec<f64>)> = None;
    for step in 0..=SHARE_STEPS {
        let share = step as f64 / SHARE_STEPS as f64;
        let unit = [Layer::new("in", 0.0, share), Layer::new("out", 0.0, 1.0 - share)];
        let mut rows: Vec<Vec<f64>> = points
            .iter()
            .map(|(g, b, _)| {
                let p = g.pieces(*b);
                vec![1.0, (p.len() as f64 + 1.0) / 2.0, pipelined_latency(&unit, &p)]
            })
            .collect();
        let mut params = match least_squares_rel(&rows, &y) {
            Ok(p) => p,
            Err(_) => {
                // Every run had the same piece count: no per-piece cost to separate.
                rows.iter_mut().for_each(|r| r[1] = 0.0);
                least_squares_rel(&rows, &y)?
            }
        };
        // A negative cost has no meaning: fit without that term (then check again,
        // the other may have turned negative).
        while let Some(k) = [1, 0].into_iter().find(|&k| params[k] < 0.0) {
            rows.iter_mut().for_each(|r| r[k] = 0.0);
            params = least_squares_rel(&rows, &y)?;
        }
        let err: f64 = rows
            .iter()
            .zip(&y)
            .map(|(r, yk)| {
                let f: f64 = r.iter().zip(&params).map(|(a, b)| a * b).sum();
                ((f - yk) / yk).powi(2)
            })
            .sum();
        if best.as_ref().is_none_or(|b| err < b.0) {
            best = Some((err, share, params));
        }
    }
    let (_, share, p) = best.ok_or_else(|| ModelError::Fit("no rendezvous fit".into()))?;
    let mut fit = RndvFit {
        fixed_ns: p[0],
        per_piece_ns: p[1],
        per_byte_ns: p[2],
        copy_in_share: share,
        residuals: Vec::new(),
        rms_rel: 0.0,
    };
    fit.residuals = points
        .iter()
        .map(|(g, b, v)| {
            let f = fit.latency(g, *b);
            (
                g.pipelining().to_owned(),
                Residual { size_bytes: *b, measured: *v, fitted: f, rel: (f - v) / v },
            )
        })
        .collect();
    let r: Vec<Residual> = fit.residuals.iter().map(|x| x.1.clone()).collect();
    fit.rms_rel = rms_rel(&r);
    Ok(fit)
}

fn line_of(points: &[(u64, f64)]) -> Result<Option<LineFit>, ModelError> {
    if points.is_empty() {
        Ok(None)
    } else {
        fit_line(points).map(Some)
    }
}

impl ShmModel {
    /// Fits the model to runs of the shm path, each with its geometry: the latency
    /// layers to all runs together (the layers do not depend on the pipelining
    /// settings; only the pieces do), the bandwidth bottleneck per run. Only points
    /// whose size passes `use_size` are used.
    pub fn fit(
        runs: &[(ShmGeometry, Vec<Point>)],
        use_size: impl Fn(u64) -> bool,
    ) -> Result<ShmModel, ModelError> {
        let mut eager = Vec::new();
        let mut rndv = Vec::new();
        let mut bandwidth = Vec::new();
        for (g, pts) in runs {
            let mut bw_e = Vec::new();
            let mut bw_r = Vec::new();
            for p in pts.iter().filter(|p| use_size(p.size_bytes)) {
                match (p.metric, g.is_eager(p.size_bytes)) {
                    (Metric::Latency, true) => eager.push((p.size_bytes, p.value)),
                    (Metric::Latency, false) => rndv.push((*g, p.size_bytes, p.value)),
                    (Metric::Bandwidth, true) => bw_e.push((p.size_bytes, p.time_ns())),
                    (Metric::Bandwidth, false) => bw_r.push((p.size_bytes, p.time_ns())),
                }
            }
            let label = g.pipelining().to_owned();
            bandwidth.push((*g, BandwidthFit { label, eager: line_of(&bw_e)?, rndv: line_of(&bw_r)? }));
        }
        if eager.is_empty() {
            return Err(ModelError::Fit("no eager-size latency to fit the shm path to".into()));
        }
        let eager = fit_line(&eager)?;
        let rndv = if rndv.is_empty() { None } else { Some(fit_rndv(&rndv)?) };
        Ok(ShmModel { eager, rndv, bandwidth })
    }

    /// Predicted one-way latency under `geo`, ns (None past what was fitted).
    pub fn latency(&self, geo: &ShmGeometry, bytes: u64) -> Option<f64> {
        if geo.is_eager(bytes) {
            Some(self.eager.at(bytes as f64))
        } else {
            self.rndv.as_ref().map(|r| r.latency(geo, bytes))
        }
    }

    /// The bandwidth fit for `geo`: the one measured with it, else the first (the
    /// bottleneck does not depend on the pipelining, eq. 4).
    pub fn bandwidth_fit(&self, geo: &ShmGeometry) -> Option<&BandwidthFit> {
        self.bandwidth.iter().find(|(g, _)| g == geo).or(self.bandwidth.first()).map(|(_, f)| f)
    }

    /// Predicted streaming bandwidth under `geo`, GB/s.
    pub fn bandwidth(&self, geo: &ShmGeometry, bytes: u64) -> Option<f64> {
        let f = self.bandwidth_fit(geo)?;
        let line = if geo.is_eager(bytes) { f.eager.as_ref()? } else { f.rndv.as_ref()? };
        let t = line.at(bytes as f64);
        (t > 0.0).then(|| bytes as f64 / t)
    }

    /// The layers of the latency model for a message of `bytes` under `geo`.
    pub fn layers(&self, geo: &ShmGeometry, bytes: u64) -> Vec<Layer> {
        if geo.is_eager(bytes) {
            vec![Layer::new("eager path (lumped)", self.eager.per_packet_ns, self.eager.per_byte_ns)]
        } else {
            self.rndv.as_ref().map(RndvFit::layers).unwrap_or_default()
        }
    }
}

/// A fitted model of the kernel's UDP path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatagramModel {
    /// Ping-pong one-way latency (one datagram each way), a line in `B`.
    pub latency: Option<LineFit>,
    /// Streaming: per-message cost, ns.
    pub per_message_ns: f64,
    /// Streaming: per-datagram cost, ns.
    pub per_datagram_ns: f64,
    /// Streaming: per-byte cost, ns per byte.
    pub per_byte_ns: f64,
    /// Streaming fit residuals (time per message).
    pub bandwidth_residuals: Vec<Residual>,
    /// RMS of the relative streaming residuals.
    pub bandwidth_rms_rel: f64,
}

/// Datagrams a streamed `bytes`-byte message is cut into (as `strait bench` does).
pub fn udp_datagrams(bytes: u64) -> u64 {
    bytes.div_ceil(UDP_MAX_PAYLOAD).max(1)
}

impl DatagramModel {
    /// Fits to one path's points whose size passes `use_size`.
    pub fn fit(points: &[Point], use_size: impl Fn(u64) -> bool) -> Result<DatagramModel, ModelError> {
        let lat: Vec<(u64, f64)> = points
            .iter()
            .filter(|p| {
                p.metric == Metric::Latency && use_size(p.size_bytes) && p.size_bytes <= UDP_MAX_PAYLOAD
            })
            .map(|p| (p.size_bytes, p.value))
            .collect();
        let bw: Vec<(u64, f64)> = points
            .iter()
            .filter(|p| p.metric == Metric::Bandwidth && use_size(p.size_bytes))
            .map(|p| (p.size_bytes, p.time_ns()))
            .collect();
        if lat.is_empty() && bw.is_empty() {
            return Err(ModelError::Fit("no UDP measurements to fit".into()));
        }
        let mut m = DatagramModel {
            latency: line_of(&lat)?,
            per_message_ns: 0.0,
            per_datagram_ns: 0.0,
            per_byte_ns: 0.0,
            bandwidth_residuals: Vec::new(),
            bandwidth_rms_rel: 0.0,
        };
        if bw.len() >= 2 {
            let several = bw.iter().any(|p| udp_datagrams(p.0) != udp_datagrams(bw[0].0));
            let rows: Vec<Vec<f64>> = bw
                .iter()
                .map(|&(b, _)| vec![1.0, if several { udp_datagrams(b) as f64 } else { 0.0 }, b as f64])
                .collect();
            let y: Vec<f64> = bw.iter().map(|p| p.1).collect();
            let mut rows = rows;
            let mut p = match least_squares_rel(&rows, &y) {
                Ok(p) => p,
                Err(_) => {
                    rows.iter_mut().for_each(|r| r[1] = 0.0);
                    least_squares_rel(&rows, &y)?
                }
            };
            // Negative per-message or per-datagram costs have no meaning: fit without.
            while let Some(k) = [0, 1].into_iter().find(|&k| p[k] < 0.0) {
                rows.iter_mut().for_each(|r| r[k] = 0.0);
                p = least_squares_rel(&rows, &y)?;
            }
            (m.per_message_ns, m.per_datagram_ns, m.per_byte_ns) = (p[0], p[1], p[2]);
            m.bandwidth_residuals = residuals(&bw, |b| m.message_time(b));
            m.bandwidth_rms_rel = rms_rel(&m.bandwidth_residuals);
        }
        Ok(m)
    }

    fn message_time(&self, bytes: u64) -> f64 {
        self.per_message_ns
            + udp_datagrams(bytes) as f64 * self.per_datagram_ns
            + bytes as f64 * self.per_byte_ns
    }

    /// Predicted value, or None where the path does not apply (latency above one
    /// datagram) or nothing was fitted.
    pub fn predict(&self, metric: Metric, bytes: u64) -> Option<f64> {
        match metric {
            Metric::Latency if bytes <= UDP_MAX_PAYLOAD => self.latency.as_ref().map(|l| l.at(bytes as f64)),
            Metric::Latency => None,
            Metric::Bandwidth if self.bandwidth_residuals.is_empty() => None,
            Metric::Bandwidth => {
                let t = self.message_time(bytes);
                (t > 0.0).then(|| bytes as f64 / t)
            }
        }
    }
}

/// Any path end to end: one latency line, one streaming bottleneck line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LumpedModel {
    /// One-way latency line.
    pub latency: Option<LineFit>,
    /// Streaming time per message (the bottleneck layer).
    pub bandwidth: Option<LineFit>,
}

impl LumpedModel {
    /// Fits to one path's points whose size passes `use_size`.
    pub fn fit(points: &[Point], use_size: impl Fn(u64) -> bool) -> Result<LumpedModel, ModelError> {
        let pick = |m: Metric| -> Vec<(u64, f64)> {
            points
                .iter()
                .filter(|p| p.metric == m && use_size(p.size_bytes))
                .map(|p| (p.size_bytes, p.time_ns()))
                .collect()
        };
        let m = LumpedModel {
            latency: line_of(&pick(Metric::Latency))?,
            bandwidth: line_of(&pick(Metric::Bandwidth))?,
        };
        if m.latency.is_none() && m.bandwidth.is_none() {
            return Err(ModelError::Fit("no measurements to fit".into()));
        }
        Ok(m)
    }

    /// Predicted value, or None if that metric was not fitted.
    pub fn predict(&self, metric: Metric, bytes: u64) -> Option<f64> {
        match metric {
            Metric::Latency => self.latency.as_ref().map(|l| l.at(bytes as f64)),
            Metric::Bandwidth => {
                let t = self.bandwidth.as_ref()?.at(bytes as f64);
                (t > 0.0).then(|| bytes as f64 / t)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(metric: Metric, size_bytes: u64, value: f64) -> Point {
        Point { path: "strait-shm".into(), metric, size_bytes, value }
    }

    #[test]
    fn geometry_from_env_and_pieces() {
        let g = ShmGeometry::from_env(|_| None).unwrap();
        assert_eq!(g, ShmGeometry::default());
        assert_eq!(g.max_piece, 262144 - 48);
        assert_eq!(g.pipelining(), "fine");
        assert_eq!(g.pieces(48 << 10), vec![48 << 10], "below the threshold: one piece");
        assert_eq!(g.pieces(96 << 10), vec![96 << 10], "above it but shorter than a chunk");
        assert_eq!(g.pieces(1 << 20).len(), 8);
        let c =
            ShmGeometry::from_env(|k| (k == "STRAIT_PIPELINE_THRESHOLD").then(|| "1024M".into())).unwrap();
        assert_eq!(c.pipelining(), "coarse");
        assert_eq!(c.pieces(128 << 10), vec![128 << 10]);
        assert_eq!(c.pieces(256 << 10), vec![262144 - 48, 48], "the ring caps a piece");
        assert!(ShmGeometry::from_env(|k| (k == "STRAIT_CHUNK_SIZE").then(|| "lots".into())).is_err());
        assert!(ShmGeometry::from_env(|k| (k == "STRAIT_RNDV_MODE").then(|| "cma".into())).is_err());
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    /// A synthetic shm path with known costs: the fit recovers them and predicts
    /// other sizes, in both pipelining modes.
    #[test]
    fn shm_fit_recovers_known_costs() {
        let truth = RndvFit {
            fixed_ns: 1500.0,
            per_piece_ns: 400.0,
            per_byte_ns: 0.12,
            copy_in_share: 0.45,
            residuals: Vec::new(),
            rms_rel: 0.0,
        };
        let (eg, eb) = (300.0, 0.06);
        let fine = ShmGeometry::default();
        let coarse = ShmGeometry { pipeline_threshold: COARSE_THRESHOLD, ..fine };
        let sizes: Vec<u64> = (10..=22).map(|e| 3u64 << e).collect();
        let runs: Vec<(ShmGeometry, Vec<Point>)> = [fine, coarse]
            .iter()
            .map(|g| {
                let pts = sizes
                    .iter()
                    .flat_map(|&b| {
                        let lat = if g.is_eager(b) { eg + eb * b as f64 } else { truth.latency(g, b) };
                        let bw = b as f64 / (200.0 + 0.07 * b as f64);
                        [pt(Metric::Latency, b, lat), pt(Metric::Bandwidth, b, bw)]
                    })
                    .collect();
                (*g, pts)
            })
            .collect();
        let m = ShmModel::fit(&runs, |_| true).unwrap();
        assert!((m.eager.per_packet_ns - eg).abs() < 1e-6 && (m.eager.per_byte_ns - eb).abs() < 1e-9);
        let r = m.rndv.as_ref().unwrap();
        assert!(r.rms_rel < 0.005, "{r:?}");
        assert!((r.per_byte_ns - 0.12).abs() / 0.12 < 0.02, "{r:?}");
        // Predicts sizes it never saw, both modes, within 1%.
        for g in [fine, coarse] {
            for b in [64u64 << 10, 256 << 10, 1 << 20, 4 << 20] {
                let want = truth.latency(&g, b);
                let got = m.latency(&g, b).unwrap();
                assert!((got - want).abs() / want < 0.01, "{} {b}: {got} vs {want}", g.pipelining());
                let bw = m.bandwidth(&g, b).unwrap();
                let want_bw = b as f64 / (200.0 + 0.07 * b as f64);
                assert!((bw - want_bw).abs() / want_bw < 1e-6);
            }
        }
        // At 192 KiB fine pipelining (two chunks, the copies overlap) beats coarse (one piece).
        assert!(m.latency(&fine, 192 << 10).unwrap() < m.latency(&coarse, 192 << 10).unwrap());
    }

    /// Per-byte costs that grow with the size (caches) pull the intercepts below
    /// zero in an unconstrained fit; the fitted handshake and per-piece costs stay >= 0.
    #[test]
    fn shm_fit_costs_are_never_negative() {
        let fine = ShmGeometry::default();
        let coarse = ShmGeometry { pipeline_threshold: COARSE_THRESHOLD, ..fine };
        let runs: Vec<(ShmGeometry, Vec<Point>)> = [fine, coarse]
            .iter()
            .map(|g| {
                let pts = (10..=21)
                    .map(|e| 3u64 << e)
                    .map(|b| {
                        let x = b as f64;
                        let lat = if g.is_eager(b) { 400.0 + 0.06 * x } else { x * (0.06 + 0.01 * x.log2()) };
                        pt(Metric::Latency, b, lat)
                    })
                    .collect();
                (*g, pts)
            })
            .collect();
        let r = ShmModel::fit(&runs, |_| true).unwrap().rndv.unwrap();
        assert!(r.fixed_ns >= 0.0 && r.per_piece_ns >= 0.0 && r.per_byte_ns > 0.0, "{r:?}");
    }

    #[test]
    fn shm_fit_needs_data() {
        assert!(ShmModel::fit(&[], |_| true).is_err());
        let g = ShmGeometry::default();
        let only_rndv = vec![(g, vec![pt(Metric::Latency, 1 << 20, 5e4)])];
        assert!(ShmModel::fit(&only_rndv, |_| true).is_err());
        let two_rndv = vec![(
            g,
            vec![
                pt(Metric::Latency, 4096, 500.0),
                pt(Metric::Latency, 1 << 20, 5e4),
                pt(Metric::Latency, 2 << 20, 1e5),
            ],
        )];
        assert!(ShmModel::fit(&two_rndv, |_| true).is_err(), "3 parameters need 3 sizes");
    }

    #[test]
    fn udp_model_counts_datagrams() {
        assert_eq!(udp_datagrams(1), 1);
        assert_eq!(udp_datagrams(65507), 1);
        assert_eq!(udp_datagrams(65508), 2);
        let t = |b: u64| 3000.0 + 2500.0 * udp_datagrams(b) as f64 + 0.15 * b as f64;
        let pts: Vec<Point> = [4096u64, 16384, 65536, 262144, 1 << 20, 4 << 20]
            .iter()
            .flat_map(|&b| {
                [
                    Point {
                        path: "kernel-udp".into(),
                        metric: Metric::Bandwidth,
                        size_bytes: b,
                        value: b as f64 / t(b),
                    },
                    Point {
                        path: "kernel-udp".into(),
                        metric: Metric::Latency,
                        size_bytes: b,
                        value: 9000.0 + 0.2 * b as f64,
                    },
                ]
            })
            .collect();
        let m = DatagramModel::fit(&pts, |_| true).unwrap();
        assert!((m.per_datagram_ns - 2500.0).abs() < 1.0, "{m:?}");
        assert!((m.per_message_ns - 3000.0).abs() < 1.0, "{m:?}");
        assert!(m.predict(Metric::Latency, 1 << 20).is_none(), "no ping-pong above one datagram");
        let l = m.predict(Metric::Latency, 8192).unwrap();
        assert!((l - (9000.0 + 0.2 * 8192.0)).abs() < 1e-6);
        assert!(DatagramModel::fit(&[], |_| true).is_err());
    }

    #[test]
    fn lumped_model() {
        let pts: Vec<Point> = [1024u64, 4096, 65536]
            .iter()
            .map(|&b| Point {
                path: "pipe".into(),
                metric: Metric::Latency,
                size_bytes: b,
                value: 7000.0 + 0.2 * b as f64,
            })
            .collect();
        let m = LumpedModel::fit(&pts, |_| true).unwrap();
        assert!((m.predict(Metric::Latency, 8192).unwrap() - (7000.0 + 0.2 * 8192.0)).abs() < 1e-6);
        assert!(m.predict(Metric::Bandwidth, 8192).is_none());
        assert!(LumpedModel::fit(&pts, |_| false).is_err());
    }
}
