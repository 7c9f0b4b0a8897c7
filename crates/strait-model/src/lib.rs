//! strait-model: an analytical model of a layered communication path.
//!
//! Each layer `i` of a path has a per-packet cost `g_i` and a per-byte cost `G_i`
//! ([`equations`]). Under coarse-grained pipelining the one-way latency of a
//! `B`-byte packet is `Σ (g_i + B·G_i)` and the streaming bandwidth
//! `B / (g_b + B·G_b)` for the bottleneck layer `b`; under fine-grained pipelining
//! with threshold `t` the latency is `Σ_{i≠e} (g_i + t·G_i) + g_e + B·Γ_e` and the
//! bandwidth converges to the coarse figure (the E-UDP paper's equations 1-4).
//!
//! The parameters come from measurements ([`data`]): per stage from `strait
//! anatomy` ([`layers`]), or per path from `strait bench` ([`paths`]: strait's shm
//! path with its eager/rendezvous protocols and pipelined pieces, the kernel's UDP
//! path with its datagrams, any other path end to end), by relative least squares
//! with the residuals kept ([`fit`]). [`validate`] fits on some sizes and compares
//! the predictions with the measurements at the others ([`check`]); [`machine`]
//! reads what-if descriptions in TOML; [`plot`] draws predicted curves beside
//! measured points. The command is `strait model`; docs/MODEL.md explains it.

pub mod check;
pub mod data;
pub mod equations;
pub mod fit;
pub mod layers;
pub mod machine;
pub mod paths;
pub mod plot;
pub mod validate;

use thiserror::Error;

pub use check::{Case, Median};
pub use data::{Metric, Point};
pub use equations::{Layer, Pipelining};
pub use paths::{DatagramModel, LumpedModel, ShmGeometry, ShmModel};
pub use validate::{CheckReport, FittedModel};

/// Why the model could not be built or used.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A measurement document or description is malformed or lacks something.
    #[error("input: {0}")]
    Input(String),
    /// The measurements do not determine the parameters.
    #[error("fit: {0}")]
    Fit(String),
}
