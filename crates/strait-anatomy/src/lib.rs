//! strait-anatomy: the measurement kit behind `strait bench` (and later
//! `strait anatomy`).
//!
//! - [`clock`]: a calibrated TSC timestamp clock (fallback `CLOCK_MONOTONIC`);
//! - [`sys`]: process CPU time, real-syscall counting via `perf_event_open` on
//!   `raw_syscalls:sys_enter`, shared memory and futex helpers;
//! - [`stats`]: percentiles; [`size`]: size parsing and printing;
//! - [`transport`]: the [`Transport`]/[`TransportSpec`] traits, one impl per
//!   mechanism: [`kernel`] (TCP, UDP, Unix stream, pipe) and [`floor`] (spin-floor);
//! - [`harness`]: peer processes and the interleaved-rounds driver;
//! - [`report`]: the JSON schema, the table and the SVG chart.
//!
//! strait's own transport (`strait-shm`) lives in the `strait` crate, which depends
//! on the engine; this crate stays below the engine so the engine can use its probes.

pub mod anatomy;
pub mod clock;
pub mod floor;
pub mod harness;
pub mod kanatomy;
pub mod kernel;
pub mod ktrace;
pub mod report;
pub mod size;
pub mod stages;
pub mod stats;
pub mod sys;
pub mod transport;

pub use clock::{Clock, ClockSource};
pub use harness::{BenchConfig, Peer, PeerLauncher, Progress};
pub use report::{BenchReport, Kind, MachineInfo, ResultRow, TransportInfo};
pub use transport::{BenchError, HelperCost, Pending, Support, Transport, TransportSpec};

/// The transports this crate implements: the kernel paths and the physical floor.
pub fn builtin_specs() -> Vec<&'static dyn TransportSpec> {
    vec![
        &kernel::KernelTcp,
        &kernel::KernelUdp,
        &kernel::UnixStreamSpec,
        &kernel::PipeSpec,
        &floor::SpinFloor,
    ]
}
