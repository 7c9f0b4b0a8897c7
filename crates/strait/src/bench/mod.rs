//! `strait bench`: the transports it compares.
//!
//! The harness, statistics, kernel transports and the spin-floor live in
//! [`strait_anatomy`]; strait's own transport, which needs the engine, lives here.

use strait_anatomy::{BenchError, TransportSpec};

pub mod native;
pub mod run;
pub mod shm;
pub mod udp;
pub mod xdp;

/// Every transport `strait bench` knows, in report order: strait's native path
/// and the path `strait run` gives unchanged programs first, then the kernel paths,
/// then the physical floor.
pub fn specs() -> Vec<&'static dyn TransportSpec> {
    let mut v: Vec<&'static dyn TransportSpec> = Vec::new();
    v.push(&shm::StraitShm);
    v.push(&run::StraitRun);
    v.extend(strait_anatomy::builtin_specs());
    v
}

/// The transports of `--across-netns`, in report order: the kernel's, then
/// strait's devices for leaving the host.
pub fn across_specs() -> Vec<&'static dyn TransportSpec> {
    vec![
        &strait_anatomy::kernel::KernelTcp,
        &strait_anatomy::kernel::KernelUdp,
        &udp::StraitUdp,
        &xdp::StraitXdp,
    ]
}

/// Looks transports up by name, in the order given.
pub fn select(names: &[String]) -> Result<Vec<&'static dyn TransportSpec>, BenchError> {
    let mut all = specs();
    for s in across_specs() {
        if !all.iter().any(|a| a.name() == s.name()) {
            all.push(s);
        }
    }
    names
        .iter()
        .map(|n| {
            all.iter().copied().find(|s| s.name() == n).ok_or_else(|| BenchError::UnknownTransport {
                name: n.clone(),
                known: all.iter().map(|s| s.name()).collect::<Vec<_>>().join(", "),
            })
        })
        .collect()
}
