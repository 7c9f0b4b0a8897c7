//! strait's deterministic network simulator.
//!
//! A seeded virtual network and clock ([`SimNet`]) with per-direction latency,
//! jitter, bandwidth, loss, duplication, reordering, corruption, truncation and
//! scheduled partitions; [`SimLink`], the [`strait_core::Link`] the reliability
//! layer ([`strait_core::reliable::Reliable`]) runs over; and a driver ([`Sim`]) that
//! runs the real protocol engine in many sans-IO [`strait_core::Engine`]s on virtual
//! time (no eventfd, clock read or sleep per simulated host).
//! Every run is a pure function of its seed: rerun a failure with the seed it
//! prints (`STRAIT_SIM_SEED`, see [`seed_from_env`]).
//!
//! ```
//! use strait_sim::{traffic, LinkParams};
//! let mut sc = traffic::Scenario::new(7);
//! sc.params = LinkParams::lossy(0.05);
//! sc.sizes = vec![(0, 100), (2000, 5000)];
//! let report = traffic::run(&sc);
//! report.assert_all_delivered();
//! ```
//!
//! See `docs/SIM.md` for the model and how to reproduce a failing seed.

pub mod driver;
pub mod net;
pub mod rng;
pub mod traffic;

pub use driver::{Handler, Limits, RunStats, Sim, SimError};
pub use net::{
    DirId, DirStats, Fault, LinkConfig, LinkParams, PairId, SimLink, SimNet, TraceEvent, TraceKind, Tracer,
    START_NS,
};
pub use rng::SimRng;

/// The seed to use: `STRAIT_SIM_SEED` if set (decimal or `0x` hex), else `default`.
///
/// # Panics
/// If `STRAIT_SIM_SEED` is set but not a number.
pub fn seed_from_env(default: u64) -> u64 {
    match std::env::var("STRAIT_SIM_SEED") {
        Ok(v) => {
            let t = v.trim();
            let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => t.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("STRAIT_SIM_SEED={v:?} is not a number"))
        }
        Err(_) => default,
    }
}
