//! Which backend `auto` takes on this host, measured rather than assumed.
//!
//! The io_uring backend was the default from the host it was built on. On a 2-core
//! Intel Xeon VM the `sendmmsg`/`recvmmsg` backend was faster in every cell measured
//! across a veth pair (8 B one-way 2.5 us against 3.3-3.6 us, 16 KiB 11.1 against
//! 13.1 us, 1 KiB streaming 2.2 against 1.5 GB/s, 1 MiB 3.7 against 3.4;
//! docs/PERFORMANCE.md section 45): a lone datagram that reaches an io_uring
//! multishot receive costs the sender the poll wake-up and the queueing of task
//! work, and the receiver a system call to run it. A constant is wrong somewhere,
//! so [`Backend::Auto`] follows a short measurement of both backends on this host:
//! two links on loopback, one per thread, each thread on its own CPU, both spinning
//! as a busy-polling worker does, exchange 8-byte datagrams, each sent alone with
//! [`Link::push`]. The best mean round trip of three runs counts, and `mmsg` is
//! chosen when it is at least 5% faster; else io_uring (which also carries
//! zero-copy sends and registered buffers).
//!
//! Why the round trip and not a streaming rate: the raw links' streaming rate was
//! measured too and did not predict the device's. On the same host io_uring
//! streamed full-size datagrams on loopback 1.25x faster than mmsg, yet the device
//! over it streamed slower (the reliability layer's per-packet work and its
//! acknowledgements, lone datagrams in the other direction, dominate a stream), while
//! the round trip put the two in the device's order (mmsg 0.80x io_uring's round trip on
//! loopback, 0.74x one way across veth).
//!
//! About 20 ms, cached per host like the shm device's calibration
//! ([`strait_sys::calcache`], file `udp-backend`). `STRAIT_CALIBRATE=off` (or a
//! choice forced for the shm device) skips the measurement (io_uring, as before);
//! `STRAIT_UDP_BACKEND=uring|mmsg` bypasses it; `STRAIT_CALIBRATE=fresh` measures
//! again.

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use strait_core::Link;
use strait_sys::calcache;

use crate::{Backend, UdpConfig, UdpLink};

/// Where a [`BackendCalibration`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Measured by this process.
    Measured,
    /// Read from the cache file.
    Cached(std::path::PathBuf),
    /// `STRAIT_CALIBRATE` set to `off` or to a forced shm choice: no measurement,
    /// io_uring.
    Off,
    /// A backend could not be set up or did not answer on loopback.
    Unmeasurable,
}

/// The result of the calibration: the backend [`Backend::Auto`] takes.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendCalibration {
    /// [`Backend::Uring`] or [`Backend::Mmsg`].
    pub choice: Backend,
    /// The io_uring backend's best mean round trip, ns (0 if not measured).
    pub uring_round_trip_ns: f64,
    /// The mmsg backend's, ns (0 if not measured).
    pub mmsg_round_trip_ns: f64,
    /// Where it came from.
    pub source: Source,
}

impl BackendCalibration {
    /// One line for reports: what was chosen and why.
    pub fn describe(&self) -> String {
        let name = backend_name(self.choice);
        match &self.source {
            Source::Off => format!("udp backend auto = {name} (not measured: STRAIT_CALIBRATE)"),
            Source::Unmeasurable => {
                format!("udp backend auto = {name} (the other backend could not be measured)")
            }
            s => format!(
                "udp backend auto = {name} (8 B round trip measured on this host over loopback: io_uring \
                 {:.2} us, mmsg {:.2} us; {})",
                self.uring_round_trip_ns / 1e3,
                self.mmsg_round_trip_ns / 1e3,
                match s {
                    Source::Cached(p) => format!("cached in {}", p.display()),
                    _ => "measured now".into(),
                }
            ),
        }
    }
}

fn backend_name(b: Backend) -> &'static str {
    match b {
        Backend::Mmsg => "mmsg",
        _ => "uring",
    }
}

/// mmsg must be faster by this factor to be chosen.
const MARGIN: f64 = 1.05;

/// The choice for two measured round trips, ns (0 = could not run).
pub fn decide(uring_round_trip_ns: f64, mmsg_round_trip_ns: f64) -> Backend {
    if mmsg_round_trip_ns <= 0.0 {
        Backend::Uring
    } else if uring_round_trip_ns <= 0.0 || mmsg_round_trip_ns * MARGIN <= uring_round_trip_ns {
        Backend::Mmsg
    } else {
        Backend::Uring
    }
}

/// Cache file name, beside the shm device's.
const CACHE_NAME: &str = "udp-backend";

/// This host's choice for [`Backend::Auto`]: from the cache if valid, else measured
/// (and cached). Never fails: whatever goes wrong leaves io_uring.
pub fn calibration() -> &'static BackendCalibration {
    static C: OnceLock<BackendCalibration> = OnceLock::new();
    C.get_or_init(|| {
        let mode = std::env::var("STRAIT_CALIBRATE").unwrap_or_default();
        let unmeasured = |choice, source| BackendCalibration {
            choice,
            uring_round_trip_ns: 0.0,
            mmsg_round_trip_ns: 0.0,
            source,
        };
        // `off`, and a choice forced for the shm device (a deterministic run), measure
        // nothing here either.
        if !(mode.is_empty() || mode == "fresh") {
            return unmeasured(Backend::Uring, Source::Off);
        }
        let cache = calcache::Cache::new(CACHE_NAME);
        let fresh = mode == "fresh";
        if !fresh {
            if let Some(c) = cache.as_ref().and_then(load) {
                return c;
            }
        }
        // One process measures at a time; the others wait for its result.
        let _lock = cache.as_ref().and_then(calcache::Cache::lock);
        if !fresh {
            if let Some(c) = cache.as_ref().and_then(load) {
                return c;
            }
        }
        let keep = calcache::quiet();
        let (uring, mmsg) = (measure(Backend::Uring), measure(Backend::Mmsg));
        let (Some(uring_round_trip_ns), Some(mmsg_round_trip_ns)) = (uring, mmsg) else {
            return BackendCalibration {
                choice: decide(uring.unwrap_or(0.0), mmsg.unwrap_or(0.0)),
                uring_round_trip_ns: uring.unwrap_or(0.0),
                mmsg_round_trip_ns: mmsg.unwrap_or(0.0),
                source: Source::Unmeasurable,
            };
        };
        let c = BackendCalibration {
            choice: decide(uring_round_trip_ns, mmsg_round_trip_ns),
            uring_round_trip_ns,
            mmsg_round_trip_ns,
            source: Source::Measured,
        };
        if let Some(cache) = &cache {
            let _ = store(cache, &c, keep && calcache::quiet());
        }
        c
    })
}

/// Writes `c` to the cache; `quiet`: the machine was quiet while measuring.
fn store(cache: &calcache::Cache, c: &BackendCalibration, quiet: bool) -> std::io::Result<()> {
    cache.store(
        &[
            ("choice", backend_name(c.choice).to_owned()),
            ("uring_round_trip_ns", format!("{:.1}", c.uring_round_trip_ns)),
            ("mmsg_round_trip_ns", format!("{:.1}", c.mmsg_round_trip_ns)),
        ],
        quiet,
    )
}

/// The cached calibration, if the cache is valid and agrees with the rule.
fn load(cache: &calcache::Cache) -> Option<BackendCalibration> {
    let f = cache.load()?;
    let num = |k: &str| f.get(k).and_then(|v| v.parse::<f64>().ok()).filter(|v| v.is_finite() && *v > 0.0);
    let (uring_round_trip_ns, mmsg_round_trip_ns) = (num("uring_round_trip_ns")?, num("mmsg_round_trip_ns")?);
    let choice = match f.get("choice")?.as_str() {
        "uring" => Backend::Uring,
        "mmsg" => Backend::Mmsg,
        _ => return None,
    };
    // The file must agree with the rule, or it was not written by it.
    (decide(uring_round_trip_ns, mmsg_round_trip_ns) == choice).then(|| BackendCalibration {
        choice,
        uring_round_trip_ns,
        mmsg_round_trip_ns,
        source: Source::Cached(cache.path().to_owned()),
    })
}

/// Round trips per run, after [`WARM`] unmeasured ones.
const ROUND_TRIPS: u32 = 1000;
const WARM: u32 = 200;
/// Runs; the best counts (the others saw interference).
const RUNS: usize = 3;
/// No run may take longer (a datagram lost on loopback, a stalled thread).
const RUN_LIMIT: Duration = Duration::from_millis(200);
/// The measured datagram's length.
const LEN: usize = 8;

/// The best mean round trip of [`RUNS`] runs on `backend`, ns, or `None` if the
/// links could not be made or no run finished.
pub fn measure(backend: Backend) -> Option<f64> {
    // Datagrams of an Ethernet MTU, as across hosts (loopback's would be 64 KiB).
    let cfg = UdpConfig { backend, max_datagram: 1472, ..UdpConfig::default() };
    let (mut a, b) = pair(&cfg)?;
    let cpus = strait_sys::cpu::allowed();
    let (cpu_a, cpu_b) = if cpus.len() >= 2 { (Some(cpus[0]), Some(cpus[1])) } else { (None, None) };
    let stop = AtomicBool::new(false);
    let mut best = f64::INFINITY;
    std::thread::scope(|s| {
        let stop = &stop;
        s.spawn(move || {
            let old = cpu_b.and_then(strait_sys::cpu::pin);
            echo(b, stop);
            strait_sys::cpu::unpin(old);
        });
        let old = cpu_a.and_then(strait_sys::cpu::pin);
        for _ in 0..RUNS {
            match ping_pong(&mut a) {
                Some(ns) => best = best.min(ns),
                None => break,
            }
        }
        strait_sys::cpu::unpin(old);
        stop.store(true, Ordering::Release);
    });
    best.is_finite().then_some(best)
}

/// Two links of `cfg` on loopback, connected to each other.
fn pair(cfg: &UdpConfig) -> Option<(UdpLink, UdpLink)> {
    let sa = UdpSocket::bind("127.0.0.1:0").ok()?;
    let sb = UdpSocket::bind("127.0.0.1:0").ok()?;
    sa.connect(sb.local_addr().ok()?).ok()?;
    sb.connect(sa.local_addr().ok()?).ok()?;
    Some((UdpLink::from_socket(sa, cfg).ok()?, UdpLink::from_socket(sb, cfg).ok()?))
}

/// Sends one datagram of [`LEN`] bytes alone; false if the link refused it.
fn send_alone(l: &mut UdpLink) -> bool {
    let Some(slot) = l.tx_alloc() else { return false };
    l.tx_buf(slot)[..LEN].fill(0x5a);
    let ok = l.send(slot, LEN).unwrap_or(false);
    l.tx_release(slot);
    ok && l.push().is_ok()
}

/// The answering side: sends one datagram back for each that comes, until `stop`.
fn echo(mut l: UdpLink, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        let mut n: u32 = 0;
        while l.recv(&mut |_| n += 1).unwrap_or(false) {}
        for _ in 0..n {
            send_alone(&mut l);
        }
    }
}

/// Mean round trip of [`ROUND_TRIPS`] lone datagrams, ns; `None` past [`RUN_LIMIT`].
fn ping_pong(l: &mut UdpLink) -> Option<f64> {
    let end = Instant::now() + RUN_LIMIT;
    let mut start = Instant::now();
    for i in 0..WARM + ROUND_TRIPS {
        if i == WARM {
            start = Instant::now();
        }
        if !send_alone(l) {
            return None;
        }
        while !l.recv(&mut |_| {}).ok()? {
            if Instant::now() > end {
                return None;
            }
        }
    }
    Some(start.elapsed().as_nanos() as f64 / f64::from(ROUND_TRIPS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmsg_needs_a_clear_margin() {
        assert_eq!(decide(5000.0, 4000.0), Backend::Mmsg);
        assert_eq!(decide(5000.0, 4900.0), Backend::Uring, "within the margin");
        assert_eq!(decide(4000.0, 5000.0), Backend::Uring);
        assert_eq!(decide(5000.0, 0.0), Backend::Uring, "mmsg not measured");
        assert_eq!(decide(0.0, 5000.0), Backend::Mmsg, "io_uring not measured");
        assert_eq!(decide(0.0, 0.0), Backend::Uring);
    }

    #[test]
    fn both_backends_measure_on_loopback() {
        for b in [Backend::Uring, Backend::Mmsg] {
            let ns = measure(b).expect("a loopback measurement");
            assert!(ns > 0.0, "{b:?}: {ns}");
        }
    }

    #[test]
    fn a_cache_round_trips_and_must_agree_with_the_rule() {
        use std::os::unix::fs::DirBuilderExt;
        let d = std::env::temp_dir().join(format!("strait-udpcal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::DirBuilder::new().mode(0o700).create(&d).unwrap();
        let cache = calcache::Cache::at(d.join("udp-backend"), "h".into());
        let c = BackendCalibration {
            choice: Backend::Mmsg,
            uring_round_trip_ns: 5600.0,
            mmsg_round_trip_ns: 4400.0,
            source: Source::Measured,
        };
        store(&cache, &c, true).unwrap();
        let back = load(&cache).expect("valid cache");
        assert_eq!(
            (back.choice, back.source.clone()),
            (Backend::Mmsg, Source::Cached(cache.path().to_owned()))
        );
        // Edited to force the other backend: contradicts its numbers, not taken.
        let text = std::fs::read_to_string(cache.path()).unwrap().replace("choice=mmsg", "choice=uring");
        std::fs::write(cache.path(), text).unwrap();
        assert!(load(&cache).is_none(), "a cache contradicting its own numbers was trusted");
        let _ = std::fs::remove_dir_all(&d);
    }
}
