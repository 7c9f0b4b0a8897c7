//! What-if descriptions of a machine for `strait model predict`, in TOML:
//!
//! ```toml
//! sizes = ["4K", "64K", "1M", "4M"]   # optional (default 1K..4M, powers of 4)
//! model = "model.json"                # a fitted model (relative to this file), for [shm]
//!
//! [shm]                               # strait's shm path with other settings
//! pipeline_threshold = "1G"           # coarse-grained pipelining
//! chunk_size = "64K"
//! eager_threshold = "32K"
//! ring_size = "1M"
//! copy_speedup = 2.0                  # a copy engine twice as fast (per-byte costs / 2)
//! per_packet_speedup = 1.0            # per-packet costs / this
//!
//! [[path]]                            # a layered path described directly
//! name = "host + 10G link"
//! pipelining = "fine"                 # or "coarse"
//! threshold = "4K"                    # fine-grained threshold t
//! layers = [
//!   { name = "host", per_packet_ns = 2000.0 },
//!   { name = "link", per_packet_ns = 500.0, per_byte_ns = 0.8, speedup = 10.0 },
//! ]
//! ```

use serde::{Deserialize, Serialize};

use crate::equations::{coarse_bandwidth, latency, Layer, Pipelining};
use crate::paths::{parse_size, ShmGeometry, ShmModel};
use crate::ModelError;

/// A size written as a number of bytes or a string with a k/M/G suffix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SizeSpec {
    /// Bytes.
    Bytes(u64),
    /// `"64K"`, `"1M"`...
    Text(String),
}

impl SizeSpec {
    /// The size in bytes.
    pub fn bytes(&self) -> Result<u64, ModelError> {
        match self {
            SizeSpec::Bytes(b) => Ok(*b),
            SizeSpec::Text(t) => parse_size(t),
        }
    }
}

/// One layer of a `[[path]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerSpec {
    /// Name.
    pub name: String,
    /// Per-packet cost `g_i`, ns.
    #[serde(default)]
    pub per_packet_ns: f64,
    /// Per-byte cost `G_i`, ns per byte.
    #[serde(default)]
    pub per_byte_ns: f64,
    /// Both costs are divided by this (a faster layer); default 1.
    #[serde(default)]
    pub speedup: Option<f64>,
}

/// A layered path described directly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathSpec {
    /// Name shown in tables and plots.
    pub name: String,
    /// `coarse` (default) or `fine`.
    #[serde(default)]
    pub pipelining: Option<String>,
    /// Fine-grained threshold `t` (required for `fine`).
    #[serde(default)]
    pub threshold: Option<SizeSpec>,
    /// The layers, top (sender's application) first.
    pub layers: Vec<LayerSpec>,
}

/// What-if settings for strait's shm path.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShmSpec {
    /// `STRAIT_EAGER_THRESHOLD`.
    pub eager_threshold: Option<SizeSpec>,
    /// `STRAIT_PIPELINE_THRESHOLD`.
    pub pipeline_threshold: Option<SizeSpec>,
    /// `STRAIT_CHUNK_SIZE`.
    pub chunk_size: Option<SizeSpec>,
    /// `STRAIT_SHM_RING_SIZE`.
    pub ring_size: Option<SizeSpec>,
    /// Per-byte costs are divided by this.
    pub copy_speedup: Option<f64>,
    /// Per-packet (and per-piece) costs are divided by this.
    pub per_packet_speedup: Option<f64>,
}

/// A whole machine description.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Machine {
    /// Sizes to predict at.
    #[serde(default)]
    pub sizes: Option<Vec<SizeSpec>>,
    /// A fitted model file (JSON written by `strait model fit --save` or `check`).
    #[serde(default)]
    pub model: Option<String>,
    /// The shm what-if.
    #[serde(default)]
    pub shm: Option<ShmSpec>,
    /// Directly described paths.
    #[serde(default)]
    pub path: Vec<PathSpec>,
}

fn factor(v: Option<f64>, what: &str) -> Result<f64, ModelError> {
    match v {
        None => Ok(1.0),
        Some(x) if x.is_finite() && x > 0.0 => Ok(x),
        Some(x) => Err(ModelError::Input(format!("{what} = {x}: must be a positive number"))),
    }
}

impl Machine {
    /// Parses and validates a TOML description.
    pub fn parse(text: &str) -> Result<Machine, ModelError> {
        let m: Machine = toml::from_str(text).map_err(|e| ModelError::Input(format!("machine TOML: {e}")))?;
        m.sizes()?;
        for p in &m.path {
            p.pipelining()?;
            p.layers()?;
        }
        if let Some(s) = &m.shm {
            factor(s.copy_speedup, "shm.copy_speedup")?;
            factor(s.per_packet_speedup, "shm.per_packet_speedup")?;
            for v in
                [&s.eager_threshold, &s.pipeline_threshold, &s.chunk_size, &s.ring_size].into_iter().flatten()
            {
                v.bytes()?;
            }
            if m.model.is_none() {
                return Err(ModelError::Input(
                    "[shm] needs `model = \"...\"`: a fitted model to start from".into(),
                ));
            }
        }
        if m.shm.is_none() && m.path.is_empty() {
            return Err(ModelError::Input("the machine describes nothing: add [shm] or [[path]]".into()));
        }
        Ok(m)
    }

    /// The sizes to predict at (default 1K, 4K, ... 4M).
    pub fn sizes(&self) -> Result<Vec<u64>, ModelError> {
        match &self.sizes {
            None => Ok((0..7).map(|i| 1024u64 << (2 * i)).collect()),
            Some(v) => {
                let s: Vec<u64> = v.iter().map(SizeSpec::bytes).collect::<Result<_, _>>()?;
                if s.is_empty() || s.contains(&0) {
                    return Err(ModelError::Input("sizes must be a non-empty list of positive sizes".into()));
                }
                Ok(s)
            }
        }
    }
}

impl PathSpec {
    /// The pipelining of this path.
    pub fn pipelining(&self) -> Result<Pipelining, ModelError> {
        match self.pipelining.as_deref().unwrap_or("coarse") {
            "coarse" => Ok(Pipelining::Coarse),
            "fine" => {
                let t = self.threshold.as_ref().ok_or_else(|| {
                    ModelError::Input(format!("path {:?}: fine pipelining needs a threshold", self.name))
                })?;
                Ok(Pipelining::Fine { threshold_bytes: t.bytes()? as f64 })
            }
            other => Err(ModelError::Input(format!(
                "path {:?}: pipelining {other:?} is neither \"coarse\" nor \"fine\"",
                self.name
            ))),
        }
    }

    /// The layers with their speed-ups applied.
    pub fn layers(&self) -> Result<Vec<Layer>, ModelError> {
        if self.layers.is_empty() {
            return Err(ModelError::Input(format!("path {:?} has no layers", self.name)));
        }
        self.layers
            .iter()
            .map(|l| {
                let k = factor(l.speedup, &format!("{}.{}.speedup", self.name, l.name))?;
                let ok = |v: f64| v.is_finite() && v >= 0.0;
                if !(ok(l.per_packet_ns) && ok(l.per_byte_ns)) {
                    return Err(ModelError::Input(format!(
                        "path {:?} layer {:?}: costs must be non-negative numbers",
                        self.name, l.name
                    )));
                }
                Ok(Layer::new(l.name.clone(), l.per_packet_ns / k, l.per_byte_ns / k))
            })
            .collect()
    }

    /// Predicted (one-way latency ns, bandwidth GB/s) at `bytes`.
    pub fn predict(&self, bytes: u64) -> Result<(f64, f64), ModelError> {
        let l = self.layers()?;
        let b = bytes as f64;
        Ok((latency(&l, b, self.pipelining()?), coarse_bandwidth(&l, b)))
    }
}

impl ShmSpec {
    /// The geometry: `base` with this spec's overrides.
    pub fn geometry(&self, base: &ShmGeometry) -> Result<ShmGeometry, ModelError> {
        // Recover the ring size from the base's largest piece.
        let ring = (base.max_piece + 48) * 4;
        let get = |v: &Option<SizeSpec>, d: u64| v.as_ref().map_or(Ok(d), SizeSpec::bytes);
        Ok(ShmGeometry::new(
            get(&self.eager_threshold, base.eager_threshold)?,
            get(&self.pipeline_threshold, base.pipeline_threshold)?,
            get(&self.chunk_size, base.chunk_size)?,
            get(&self.ring_size, ring)?,
        ))
    }

    /// The model with this spec's speed-ups applied.
    pub fn scaled(&self, m: &ShmModel) -> Result<ShmModel, ModelError> {
        let c = factor(self.copy_speedup, "shm.copy_speedup")?;
        let p = factor(self.per_packet_speedup, "shm.per_packet_speedup")?;
        let mut m = m.clone();
        let scale = |l: &mut crate::fit::LineFit| {
            l.per_packet_ns /= p;
            l.per_byte_ns /= c;
        };
        scale(&mut m.eager);
        if let Some(r) = &mut m.rndv {
            r.fixed_ns /= p;
            r.per_piece_ns /= p;
            r.per_byte_ns /= c;
        }
        for (_, b) in &mut m.bandwidth {
            if let Some(l) = &mut b.eager {
                scale(l);
            }
            if let Some(l) = &mut b.rndv {
                scale(l);
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
sizes = ["4K", 65536, "1M"]
model = "model.json"

[shm]
pipeline_threshold = "1G"
chunk_size = "64K"
copy_speedup = 2.0

[[path]]
name = "host + link"
pipelining = "fine"
threshold = "4K"
layers = [
  { name = "host", per_packet_ns = 2000.0 },
  { name = "link", per_packet_ns = 500.0, per_byte_ns = 0.8, speedup = 10.0 },
]
"#;

    #[test]
    fn parses_a_full_description() {
        let m = Machine::parse(FULL).unwrap();
        assert_eq!(m.sizes().unwrap(), vec![4096, 65536, 1 << 20]);
        let p = &m.path[0];
        assert_eq!(p.pipelining().unwrap(), Pipelining::Fine { threshold_bytes: 4096.0 });
        let l = p.layers().unwrap();
        assert!((l[1].per_byte_ns - 0.08).abs() < 1e-12);
        let (lat, bw) = p.predict(1 << 20).unwrap();
        // Fine: host 2000 (t·0) + link g 50 + B·0.08.
        assert!((lat - (2000.0 + 50.0 + 0.08 * (1u64 << 20) as f64)).abs() < 1e-6);
        assert!(bw > 0.0);
        let s = m.shm.as_ref().unwrap();
        let g = s.geometry(&ShmGeometry::default()).unwrap();
        assert_eq!(g.pipelining(), "coarse");
        assert_eq!(g.chunk_size, 65536);
        assert_eq!(g.max_piece, ShmGeometry::default().max_piece, "ring size kept");
    }

    #[test]
    fn defaults_and_errors() {
        let m = Machine::parse("[[path]]\nname = \"x\"\nlayers = [{ name = \"a\", per_packet_ns = 1.0 }]\n")
            .unwrap();
        assert_eq!(m.sizes().unwrap().len(), 7);
        assert_eq!(m.path[0].pipelining().unwrap(), Pipelining::Coarse);
        for bad in [
            "",                                                                   // nothing described
            "sizes = [\"4Q\"]\n[[path]]\nname=\"x\"\nlayers=[{name=\"a\"}]",      // bad size
            "[[path]]\nname=\"x\"\nlayers=[]",                                    // no layers
            "[[path]]\nname=\"x\"\npipelining=\"fine\"\nlayers=[{name=\"a\"}]",   // no threshold
            "[[path]]\nname=\"x\"\npipelining=\"medium\"\nlayers=[{name=\"a\"}]", // unknown mode
            "[[path]]\nname=\"x\"\nlayers=[{name=\"a\", per_byte_ns=-1.0}]",      // negative cost
            "[[path]]\nname=\"x\"\nlayers=[{name=\"a\", speedup=0.0}]",           // zero speed-up
            "[[path]]\nname=\"x\"\nlayers=[{name=\"a\", colour=\"red\"}]",        // unknown field
            "[shm]\nchunk_size = \"64K\"",                                        // shm without model
            "model=\"m.json\"\n[shm]\ncopy_speedup = -2.0",                       // bad factor
            "this is not toml",
        ] {
            assert!(Machine::parse(bad).is_err(), "accepted: {bad}");
        }
    }
}
