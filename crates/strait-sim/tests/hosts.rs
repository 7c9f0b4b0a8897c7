//! A simulated host is a sans-IO engine (`strait_core::Engine`), not a `Worker`:
//! building and running a thousand of them opens no descriptor in the test process
//! (no eventfd per host, no socket), and their time is the simulator's clock.
//!
//! Alone in its test binary, so that no other test opens descriptors meanwhile.

use strait_sim::seed_from_env;
use strait_sim::traffic::{self, Scenario};

/// Descriptors open in this process now.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

#[test]
fn simulated_hosts_open_no_descriptors() {
    let seed = seed_from_env(31);
    let mut sc = Scenario::new(seed);
    sc.pairs = 500;
    sc.hosts = 0; // one host per endpoint
    sc.msgs = 4;
    sc.sizes = vec![(8, 64)];
    let before = open_fds();
    let built = traffic::build(&sc);
    assert_eq!(built.sim.hosts(), 1000);
    assert_eq!(open_fds(), before, "seed {seed}: building 1000 hosts opened descriptors");
    drop(built);
    let r = traffic::run(&sc);
    r.assert_all_delivered();
    assert_eq!(open_fds(), before, "seed {seed}: running 1000 hosts opened descriptors");
}
