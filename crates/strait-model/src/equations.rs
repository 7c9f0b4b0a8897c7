//! The model's equations: a path of layers, each with a per-packet cost `g_i` (ns)
//! and a per-byte cost `G_i` (ns per byte), moving a `B`-byte packet.
//!
//! * Coarse-grained pipelining (a layer starts on a packet only when the layer above
//!   has finished it): one-way latency `Σ_i (g_i + B·G_i)` (E-UDP paper, eq. 1);
//!   streaming bandwidth `B / (g_b + B·G_b)` for the bottleneck layer `b`, the one
//!   with the largest `g_i + B·G_i` (eq. 2).
//! * Fine-grained pipelining (a layer starts as soon as `t` bytes are ready): latency
//!   `Σ_{i≠e} (g_i + t·G_i) + g_e + B·Γ_e`, where `e` is the last layer with a
//!   per-byte cost and `Γ_e` its effective per-byte cost: it cannot consume bytes
//!   faster than the per-byte layers above it deliver them, so `Γ_e = max G_i` over
//!   the per-byte layers up to `e` (eq. 3). Bandwidth converges to the coarse figure
//!   for long streams (eq. 4).
//! * [`pipelined_latency`]: the exact schedule of a packet cut into pieces that flow
//!   through the layers one after another (a flow shop): piece `j` leaves layer `i`
//!   at `max(done(i-1, j), done(i, j-1)) + g_i + x_j·G_i`. One piece is eq. 1; many
//!   equal pieces of `t` bytes approach eq. 3. strait's shm transfers are of this
//!   kind (the pieces are the rendezvous chunks).

use serde::{Deserialize, Serialize};

/// One layer of a path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    /// What the layer is (a stage name, a resource).
    pub name: String,
    /// Per-packet cost `g_i`, ns.
    pub per_packet_ns: f64,
    /// Per-byte cost `G_i`, ns per byte.
    pub per_byte_ns: f64,
}

impl Layer {
    /// A layer with these costs.
    pub fn new(name: impl Into<String>, per_packet_ns: f64, per_byte_ns: f64) -> Layer {
        Layer { name: name.into(), per_packet_ns, per_byte_ns }
    }

    /// `g_i + B·G_i`: the time this layer spends on one `bytes`-byte packet, ns.
    pub fn time_ns(&self, bytes: f64) -> f64 {
        self.per_packet_ns + bytes * self.per_byte_ns
    }
}

/// How consecutive layers overlap on one packet.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Pipelining {
    /// A layer starts when the layer above has finished the whole packet.
    Coarse,
    /// A layer starts as soon as `threshold_bytes` are ready.
    Fine {
        /// The threshold `t`, bytes.
        threshold_bytes: f64,
    },
}

/// Coarse-grained one-way latency: `Σ_i (g_i + B·G_i)`, ns (eq. 1).
pub fn coarse_latency(layers: &[Layer], bytes: f64) -> f64 {
    layers.iter().map(|l| l.time_ns(bytes)).sum()
}

/// The bottleneck layer for `bytes`-byte packets: the largest `g_i + B·G_i`.
pub fn bottleneck(layers: &[Layer], bytes: f64) -> Option<&Layer> {
    layers.iter().max_by(|a, b| a.time_ns(bytes).total_cmp(&b.time_ns(bytes)))
}

/// Coarse-grained streaming bandwidth `B / (g_b + B·G_b)`, bytes per ns (= GB/s);
/// 0 for an empty path or a non-positive bottleneck time.
pub fn coarse_bandwidth(layers: &[Layer], bytes: f64) -> f64 {
    match bottleneck(layers, bytes) {
        Some(b) if b.time_ns(bytes) > 0.0 => bytes / b.time_ns(bytes),
        _ => 0.0,
    }
}

/// Index of the last layer with a per-byte cost (`e` of eq. 3).
pub fn last_per_byte_layer(layers: &[Layer]) -> Option<usize> {
    layers.iter().rposition(|l| l.per_byte_ns > 0.0)
}

/// Fine-grained one-way latency with threshold `t` (eq. 3), ns:
/// `Σ_{i≠e} (g_i + min(t,B)·G_i) + g_e + B·Γ_e`, `Γ_e = max_{i≤e} G_i`. With no
/// per-byte layer it is the sum of the per-packet costs.
pub fn fine_latency(layers: &[Layer], bytes: f64, threshold_bytes: f64) -> f64 {
    let Some(e) = last_per_byte_layer(layers) else {
        return layers.iter().map(|l| l.per_packet_ns).sum();
    };
    let t = threshold_bytes.clamp(0.0, bytes);
    let gamma = layers[..=e].iter().map(|l| l.per_byte_ns).fold(0.0, f64::max);
    let rest: f64 = layers.iter().enumerate().filter(|(i, _)| *i != e).map(|(_, l)| l.time_ns(t)).sum();
    rest + layers[e].per_packet_ns + bytes * gamma
}

/// Fine-grained streaming bandwidth: the coarse figure (eq. 4: after the first
/// packets the fine pipeline degenerates into the coarse one).
pub fn fine_bandwidth(layers: &[Layer], bytes: f64) -> f64 {
    coarse_bandwidth(layers, bytes)
}

/// One-way latency under `mode`, ns.
pub fn latency(layers: &[Layer], bytes: f64, mode: Pipelining) -> f64 {
    match mode {
        Pipelining::Coarse => coarse_latency(layers, bytes),
        Pipelining::Fine { threshold_bytes } => fine_latency(layers, bytes, threshold_bytes),
    }
}

/// Cuts `bytes` into pieces of `piece` bytes (the last one shorter); one piece if
/// `piece` is 0 or at least `bytes`.
pub fn pieces(bytes: u64, piece: u64) -> Vec<u64> {
    if piece == 0 || piece >= bytes {
        return vec![bytes];
    }
    let mut v = vec![piece; (bytes / piece) as usize];
    if !bytes.is_multiple_of(piece) {
        v.push(bytes % piece);
    }
    v
}

/// Exact latency of pieces flowing through the layers in order (each layer handles
/// one piece at a time, pieces in order): piece `j` leaves layer `i` at
/// `max(done(i-1, j), done(i, j-1)) + g_i + x_j·G_i`; the result is when the last
/// piece leaves the last layer, ns.
pub fn pipelined_latency(layers: &[Layer], pieces: &[u64]) -> f64 {
    let mut done = vec![0.0f64; layers.len()];
    for &x in pieces {
        let mut above = 0.0f64;
        for (i, l) in layers.iter().enumerate() {
            done[i] = above.max(done[i]) + l.time_ns(x as f64);
            above = done[i];
        }
    }
    done.last().copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1e-12)
    }

    fn path() -> Vec<Layer> {
        vec![
            Layer::new("host", 100.0, 0.0),
            Layer::new("copy in", 50.0, 0.25),
            Layer::new("copy out", 40.0, 0.5),
            Layer::new("completion", 30.0, 0.0),
        ]
    }

    #[test]
    fn coarse_latency_is_the_sum() {
        let l = path();
        // 100 + (50 + 250) + (40 + 500) + 30
        assert_eq!(coarse_latency(&l, 1000.0), 970.0);
        assert_eq!(coarse_latency(&[], 1000.0), 0.0);
    }

    #[test]
    fn coarse_bandwidth_uses_the_bottleneck() {
        let l = path();
        // Small packets: host (100 ns) is the bottleneck; large: copy out.
        assert_eq!(bottleneck(&l, 10.0).map(|b| b.name.as_str()), Some("host"));
        assert_eq!(bottleneck(&l, 1e6).map(|b| b.name.as_str()), Some("copy out"));
        assert!(close(coarse_bandwidth(&l, 10.0), 10.0 / 100.0, 1e-12));
        assert!(close(coarse_bandwidth(&l, 1e6), 1e6 / (40.0 + 0.5e6), 1e-12));
        // Long packets approach 1 / G_b.
        assert!(close(coarse_bandwidth(&l, 1e12), 2.0, 1e-6));
        assert_eq!(coarse_bandwidth(&[], 10.0), 0.0);
        assert_eq!(fine_bandwidth(&l, 1e6), coarse_bandwidth(&l, 1e6));
    }

    #[test]
    fn fine_latency_follows_eq3() {
        let l = path();
        // e = copy out (last per-byte layer), Γ_e = max(0.25, 0.5) = 0.5.
        // Σ_{i≠e}(g_i + t G_i) = 100 + (50 + 64*0.25) + 30; + g_e + B Γ_e = 40 + 1e4*0.5.
        let want = 100.0 + 50.0 + 16.0 + 30.0 + 40.0 + 5000.0;
        assert!(close(fine_latency(&l, 1e4, 64.0), want, 1e-12));
        // The downstream layer cannot outrun the upstream one: Γ is the max.
        let slow_top = vec![Layer::new("in", 0.0, 2.0), Layer::new("out", 0.0, 1.0)];
        assert!(close(fine_latency(&slow_top, 100.0, 10.0), 10.0 * 2.0 + 100.0 * 2.0, 1e-12));
        // Threshold >= B: layer e still costs B·Γ_e, the others t = B.
        assert!(fine_latency(&l, 100.0, 1e9) <= coarse_latency(&l, 100.0) + 1e-9);
        // No per-byte layer: only the per-packet costs.
        let flat = vec![Layer::new("a", 5.0, 0.0), Layer::new("b", 7.0, 0.0)];
        assert_eq!(fine_latency(&flat, 1e6, 10.0), 12.0);
        assert!(matches!(latency(&l, 1e4, Pipelining::Coarse), x if x == coarse_latency(&l, 1e4)));
    }

    #[test]
    fn fine_beats_coarse_for_large_packets() {
        let l = path();
        let b = 1e6;
        assert!(fine_latency(&l, b, 4096.0) < coarse_latency(&l, b));
    }

    #[test]
    fn pieces_cut_evenly() {
        assert_eq!(pieces(10, 4), vec![4, 4, 2]);
        assert_eq!(pieces(8, 4), vec![4, 4]);
        assert_eq!(pieces(3, 4), vec![3]);
        assert_eq!(pieces(3, 0), vec![3]);
    }

    #[test]
    fn pipeline_reduces_to_eq1_and_approaches_eq3() {
        let l = path();
        // One piece: coarse (eq. 1).
        assert!(close(pipelined_latency(&l, &[100_000]), coarse_latency(&l, 1e5), 1e-12));
        // Many equal pieces with the per-piece costs moved out: eq. 3 with t = piece.
        let bytes_only: Vec<Layer> =
            l.iter().map(|x| Layer::new(x.name.clone(), 0.0, x.per_byte_ns)).collect();
        let p = pieces(1 << 20, 1024);
        let exact = pipelined_latency(&bytes_only, &p);
        let eq3 = fine_latency(&bytes_only, (1u64 << 20) as f64, 1024.0);
        assert!(close(exact, eq3, 1e-9), "{exact} vs {eq3}");
        // With per-piece costs it lies between eq. 3 and coarse for a large message.
        let exact = pipelined_latency(&l, &p);
        assert!(exact > fine_latency(&l, (1u64 << 20) as f64, 1024.0));
        assert_eq!(pipelined_latency(&[], &p), 0.0);
    }
}
