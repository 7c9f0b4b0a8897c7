//! What the udp device's benchmark examples share: the error type, a worker over a
//! reliable udp device, waiting for one completion, kernel TCP streaming across the
//! same veth pair, and medians.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use strait_core::{Config, OpKind, Status, Worker};
use strait_udp::netns::VethPair;
use strait_udp::UdpDevice;

pub type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

pub const MIB: usize = 1 << 20;

/// A worker with `dev` attached, once the device's connection is up (at most 5 s).
pub fn worker_on(dev: UdpDevice) -> (Worker<UdpDevice>, strait_core::EpId) {
    let mut w = Worker::new(Config::from_env().unwrap_or_default()).expect("worker");
    let ep = w.attach(dev);
    let t = Instant::now();
    while !w.device(ep).is_some_and(|d| d.is_established()) && t.elapsed() < Duration::from_secs(5) {
        w.progress();
    }
    (w, ep)
}

/// The next completion of kind `op` (every completion must be Ok).
pub fn next(w: &mut Worker<UdpDevice>, op: OpKind) -> strait_core::Completion {
    loop {
        let c = w.wait(Some(Duration::from_secs(10))).expect("wait");
        assert_eq!(c.status, Status::Ok, "{c:?}");
        if c.op == op {
            return c;
        }
    }
}

/// Kernel TCP streaming `msgs` messages of 1 MiB across the pair: Gb/s.
pub fn kernel_tcp_bulk(pair: &VethPair, msgs: usize) -> Res<f64> {
    let (mut a, mut b) = pair.tcp_pair()?;
    let el = std::thread::scope(|s| {
        let rx = s.spawn(move || {
            let mut buf = vec![0u8; MIB];
            let mut left = msgs * MIB;
            let t = Instant::now();
            while left > 0 {
                let n = b.read(&mut buf[..left.min(MIB)]).unwrap();
                assert!(n > 0, "tcp closed early");
                left -= n;
            }
            t.elapsed()
        });
        let buf = vec![1u8; MIB];
        for _ in 0..msgs {
            a.write_all(&buf).unwrap();
        }
        rx.join().unwrap()
    });
    Ok((msgs * MIB) as f64 * 8.0 / el.as_secs_f64() / 1e9)
}

/// The `p` quantile (0..=1) of `v`.
pub fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn median(mut v: Vec<f64>) -> f64 {
    pct(&mut v, 0.5)
}
