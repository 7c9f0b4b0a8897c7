//! Property test: random networks and traffic drawn from a seed, many iterations,
//! each one checked message by message. Bounded in iterations and in wall time.
//!
//! `STRAIT_SIM_SEED` fixes the master seed (default 0xF022); each iteration's
//! scenario seed is printed on failure and can be rerun alone with
//! `STRAIT_SIM_FUZZ_ONE=<scenario seed>`. `STRAIT_SIM_FUZZ_ITERS` sets the number of
//! iterations (default 60).

use std::time::{Duration, Instant};

use strait_sim::rng::{mix, SimRng};
use strait_sim::traffic::{self, Scenario};
use strait_sim::{seed_from_env, LinkParams};

/// A random scenario: network faults, sizes, pairs, windows and timers from `seed`.
fn scenario(seed: u64) -> Scenario {
    let mut r = SimRng::new(seed);
    let prob = |r: &mut SimRng, max: f64| if r.chance(0.5) { r.unit() * max } else { 0.0 };
    let params = LinkParams {
        latency_ns: r.range_inclusive(1_000, 500_000),
        jitter_ns: if r.chance(0.5) { r.range_inclusive(0, 50_000) } else { 0 },
        bandwidth_bps: [0, 100_000_000, 1_000_000_000, 10_000_000_000][r.below(4) as usize],
        queue_bytes: [0, 64 * 1024, 1 << 20][r.below(3) as usize],
        loss: prob(&mut r, 0.15),
        duplicate: prob(&mut r, 0.1),
        reorder: prob(&mut r, 0.1),
        reorder_delay_ns: r.range_inclusive(1, 300_000),
        corrupt: prob(&mut r, 0.1),
        truncate: prob(&mut r, 0.03),
        ecn_mark_bytes: 0,
    };
    let mut sc = Scenario::new(seed);
    sc.params = params;
    sc.pairs = r.range_inclusive(1, 4) as usize;
    sc.hosts = [0, 1, 2][r.below(3) as usize];
    sc.bidirectional = r.chance(0.7);
    sc.msgs = r.range_inclusive(1, 30);
    sc.window = r.range_inclusive(1, 16) as usize;
    let classes =
        [(0usize, 64usize), (0, 1400), (1401, 9000), (9000, 32_768), (32_769, 200_000), (200_000, 1 << 20)];
    let n = r.range_inclusive(1, 3) as usize;
    sc.sizes = (0..n).map(|_| classes[r.below(classes.len() as u64) as usize]).collect();
    // Small windows too: the reliability layer caps its frames at half the window.
    sc.rel.window = [8, 16, 64, 128, 256][r.below(5) as usize];
    sc.rel.ack_every = r.range_inclusive(1, 16) as u32;
    sc.engine.credits = r.range_inclusive(1, 64) as u16;
    sc.close = r.chance(0.5);
    if r.chance(0.2) {
        // A partition shorter than the liveness timeout: must heal without loss.
        let from = r.range_inclusive(0, 2_000_000);
        sc.partition = Some((from, Some(from + r.range_inclusive(1, 1_000_000_000))));
    }
    // (Drawn last, so that the draws above, and the scenarios of earlier seeds,
    // stay what they were.) An ECN-marking bottleneck, ECN-capable links or both:
    // marks must slow the sender, never lose or repeat a message.
    sc.params.ecn_mark_bytes = [0, 8 * 1024, 32 * 1024][r.below(3) as usize];
    sc.link.ecn = r.chance(0.5);
    sc.limits.wall = Duration::from_secs(60);
    sc
}

#[test]
fn random_networks_deliver_every_message_exactly_once() {
    if let Ok(one) = std::env::var("STRAIT_SIM_FUZZ_ONE") {
        let seed = one.trim().parse().expect("STRAIT_SIM_FUZZ_ONE is a number");
        let sc = scenario(seed);
        println!("{sc:#?}");
        let r = traffic::run(&sc);
        println!("{}", r.summary());
        r.assert_all_delivered();
        return;
    }
    let master = seed_from_env(0xF022);
    let iters: u64 = std::env::var("STRAIT_SIM_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    let budget = Duration::from_secs(if cfg!(debug_assertions) { 120 } else { 40 });
    let start = Instant::now();
    let mut done = 0;
    for i in 0..iters {
        if start.elapsed() > budget {
            println!("wall budget spent after {done} iterations");
            break;
        }
        let seed = mix(&[master, i]);
        let sc = scenario(seed);
        let r = traffic::run(&sc);
        assert!(
            r.clean() && r.delivered == r.messages && r.sends_ok == r.messages && r.still_closing == 0,
            "master seed {master}, iteration {i}: scenario seed {seed} failed \
             (rerun alone with STRAIT_SIM_FUZZ_ONE={seed})\n{sc:#?}\n{}",
            r.summary()
        );
        done += 1;
    }
    println!("{done} random scenarios passed in {:.1} s", start.elapsed().as_secs_f64());
    assert!(done > 0);
}
