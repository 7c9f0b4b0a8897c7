//! Which rendezvous data path is fastest on this host, measured rather than assumed.
//!
//! A large message on the shm device moves one of three ways once the receiver has
//! matched it: the pipelined copy (the sender copies chunk k+1 into the ring while
//! the receiver copies chunk k out: two copies, two cores), a remote read (the
//! receiver copies straight out of the sender's buffer with `process_vm_readv`: one
//! copy, one core), or a split transfer (the receiver reads the first half while
//! the sender writes the second into the receiver's buffer with
//! `process_vm_writev`: one copy, two cores). Which wins depends on the machine: on
//! a 2-core AMD EPYC VM the copy streamed 1 MiB at ~14 GB/s against ~9 GB/s for the
//! remote read; on a 2-core Intel Xeon VM the remote read reached 10.3 GB/s against
//! 7.1, and the split 20 (docs/PERFORMANCE.md). A constant is wrong somewhere, so
//! [`RndvMode::Auto`](strait_core::RndvMode::Auto) follows a short measurement of
//! the three paths on this host, between this process (the receiver) and a helper
//! process it makes for the purpose (the sender, made by a raw `clone`), 1 MiB messages, each
//! written by the sender just before it moves (its lines then sit dirty in the
//! sender's cache, as an application's freshly written buffer does):
//!
//! * the copy path: a 4-slot ring of 128 KiB chunks in shared memory, as the engine
//!   pipelines;
//! * the remote read: `process_vm_readv` of the whole message;
//! * the split: `process_vm_readv` of the first half and, at once, the helper's
//!   `process_vm_writev` of the second.
//!
//! Two threads of one process had been used first and misjudged the paths (the
//! copy at 15-16 GB/s and the split at 9-12, against 9.4 and 20 between two
//! processes); they remain the fallback where no helper process can be made. On the
//! 2-core Intel Xeon VM, three calibrations measured copy 13-15, remote read 11 and
//! split 23 GB/s. Each path is timed three times over 64 MiB and the best run counts
//! (the others saw interference); a measurement taken while the machine was busy
//! (load average above cores less one half) is cached for ten minutes only. A
//! single-copy path is chosen when it is at least 5% faster than the copy (which
//! needs no ptrace permission and keeps working across users), and the split over
//! the remote read likewise. About 100 ms, once per host: the result is
//! cached in `$XDG_CACHE_HOME/strait/calibration` (else `~/.cache/strait/`), keyed by
//! the boot id, the CPU model and the kernel release, and used only if the file and
//! its folder belong to this user and nobody else can write them (a planted file
//! must not steer the choice). `STRAIT_CALIBRATE=off` skips the measurement (the
//! copy path, as before); `=copy`, `=remote-read` or `=split` sets the outcome
//! without measuring (deterministic runs); `=fresh` measures again.
//! `STRAIT_RNDV_MODE` other than `auto` bypasses all of this.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use strait_sys::calcache::{self, Cache};

mod pair;

/// The rendezvous data path chosen for [`RndvMode::Auto`](strait_core::RndvMode::Auto).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RndvChoice {
    /// The pipelined two-core copy through the ring.
    Copy,
    /// The receiver's single copy out of the sender's memory.
    RemoteRead,
    /// The split transfer: the receiver reads one half, the sender writes the other.
    Split,
}

impl RndvChoice {
    /// As written in the cache and in reports.
    pub fn name(self) -> &'static str {
        match self {
            RndvChoice::Copy => "copy",
            RndvChoice::RemoteRead => "remote-read",
            RndvChoice::Split => "split",
        }
    }

    fn from_name(name: &str) -> Option<RndvChoice> {
        Some(match name {
            "copy" => RndvChoice::Copy,
            "remote-read" => RndvChoice::RemoteRead,
            "split" => RndvChoice::Split,
            _ => return None,
        })
    }
}

/// Where a [`Calibration`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Measured by this process.
    Measured,
    /// Read from the cache file.
    Cached(PathBuf),
    /// `STRAIT_CALIBRATE=off`: no measurement.
    Off,
    /// `STRAIT_CALIBRATE=copy` or `=remote-read`: the choice given, not measured
    /// (deterministic runs and tests).
    Forced,
}

/// The result of the calibration.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// The path `auto` takes.
    pub choice: RndvChoice,
    /// Best measured pipelined-copy bandwidth, GB/s (0 if not measured).
    pub copy_gbps: f64,
    /// Best measured remote-read bandwidth, GB/s (0 if not measured or refused).
    pub remote_read_gbps: f64,
    /// Best measured split-transfer bandwidth, GB/s (0 if not measured or refused).
    pub split_gbps: f64,
    /// Where it came from.
    pub source: Source,
}

impl Calibration {
    /// One line for reports: what was chosen and why.
    pub fn describe(&self) -> String {
        match &self.source {
            Source::Off => "rendezvous auto = copy (STRAIT_CALIBRATE=off)".into(),
            Source::Forced => format!("rendezvous auto = {} (STRAIT_CALIBRATE)", self.choice.name()),
            s => format!(
                "rendezvous auto = {} (measured on this host: copy {:.1} GB/s, remote read {:.1} GB/s, \
                 split {:.1} GB/s; {})",
                self.choice.name(),
                self.copy_gbps,
                self.remote_read_gbps,
                self.split_gbps,
                match s {
                    Source::Cached(p) => format!("cached in {}", p.display()),
                    _ => "measured now".into(),
                }
            ),
        }
    }
}

/// A single-copy path must beat the copy by this factor to be chosen (the copy
/// needs no ptrace permission and keeps working across users), and the split must
/// beat the remote read by as much (it needs an answer from the sender).
const MARGIN: f64 = 1.05;

/// The choice for measured bandwidths (GB/s; 0 = could not run).
pub fn decide(copy_gbps: f64, remote_read_gbps: f64, split_gbps: f64) -> RndvChoice {
    let (single, gbps) = if split_gbps > 0.0 && split_gbps >= remote_read_gbps * MARGIN {
        (RndvChoice::Split, split_gbps)
    } else {
        (RndvChoice::RemoteRead, remote_read_gbps)
    };
    if gbps > 0.0 && gbps >= copy_gbps * MARGIN {
        single
    } else {
        RndvChoice::Copy
    }
}

/// Cache file name (`strait_sys::calcache`).
const CACHE_NAME: &str = "calibration";

/// This host's calibration: from the cache if valid, else measured (and cached).
/// Never fails: whatever goes wrong leaves the copy path.
pub fn calibration() -> &'static Calibration {
    static C: OnceLock<Calibration> = OnceLock::new();
    C.get_or_init(|| {
        let mode = std::env::var("STRAIT_CALIBRATE").unwrap_or_default();
        let fixed = |choice, source| Calibration {
            choice,
            copy_gbps: 0.0,
            remote_read_gbps: 0.0,
            split_gbps: 0.0,
            source,
        };
        match mode.as_str() {
            "off" => return fixed(RndvChoice::Copy, Source::Off),
            m => {
                if let Some(choice) = RndvChoice::from_name(m) {
                    return fixed(choice, Source::Forced);
                }
            }
        }
        let cache = Cache::new(CACHE_NAME);
        if mode != "fresh" {
            if let Some(c) = cache.as_ref().and_then(load) {
                return c;
            }
        }
        // One process measures at a time (two measuring at once on a small host
        // would halve each other's numbers): the others wait for its result.
        let _lock = cache.as_ref().and_then(Cache::lock);
        if mode != "fresh" {
            if let Some(c) = cache.as_ref().and_then(load) {
                return c;
            }
        }
        let keep = calcache::quiet();
        let (copy_gbps, remote_read_gbps, split_gbps) = measure();
        let c = Calibration {
            choice: decide(copy_gbps, remote_read_gbps, split_gbps),
            copy_gbps,
            remote_read_gbps,
            split_gbps,
            source: Source::Measured,
        };
        if let Some(cache) = &cache {
            let _ = store(cache, &c, keep && calcache::quiet());
        }
        c
    })
}

/// The cached calibration, if the cache is valid and agrees with the rule.
fn load(cache: &Cache) -> Option<Calibration> {
    let fields = cache.load()?;
    let choice = RndvChoice::from_name(fields.get("choice")?)?;
    let num =
        |k: &str| fields.get(k).and_then(|v| v.parse::<f64>().ok()).filter(|v| v.is_finite() && *v >= 0.0);
    let (copy_gbps, remote_read_gbps, split_gbps) =
        (num("copy_gbps")?, num("remote_read_gbps")?, num("split_gbps")?);
    // The file must agree with the rule, or it was not written by it.
    if decide(copy_gbps, remote_read_gbps, split_gbps) != choice {
        return None;
    }
    Some(Calibration {
        choice,
        copy_gbps,
        remote_read_gbps,
        split_gbps,
        source: Source::Cached(cache.path().to_owned()),
    })
}

/// Writes `c` to the cache; `quiet`: the machine was quiet while measuring.
fn store(cache: &Cache, c: &Calibration, quiet: bool) -> std::io::Result<()> {
    cache.store(
        &[
            ("choice", c.choice.name().to_owned()),
            ("copy_gbps", format!("{:.3}", c.copy_gbps)),
            ("remote_read_gbps", format!("{:.3}", c.remote_read_gbps)),
            ("split_gbps", format!("{:.3}", c.split_gbps)),
        ],
        quiet,
    )
}

/// Bytes of one measured message, and of one measured run.
const MSG: usize = 1 << 20;
const RUN: usize = 64 << 20;
const CHUNK: usize = 128 << 10;
const SLOTS: usize = 4;
/// Runs of each path; the best counts (the others saw interference).
const RUNS: usize = 3;

/// Best of three runs of each path, GB/s. The receiving side runs on one CPU and
/// the sending side on another, as two processes on a quiet host do (left to the
/// scheduler, the two threads sometimes shared a core and the numbers of two
/// calibrations differed threefold).
fn measure() -> (f64, f64, f64) {
    let cpus = strait_sys::cpu::allowed();
    let pair = (cpus.len() >= 2).then(|| (cpus[0], cpus[1]));
    let old = pair.and_then(|(rx, _)| strait_sys::cpu::pin(rx));
    let tx_cpu = pair.map(|(_, tx)| tx);
    // Between two processes, as the device runs; between two threads only where no
    // helper process can be made (a sandbox that forbids it).
    let r = pair::measure(RUNS, tx_cpu).unwrap_or_else(|| {
        let mut src = vec![0u8; MSG];
        let mut dst = vec![0u8; MSG];
        let best = |f: &mut dyn FnMut() -> Option<f64>| (0..RUNS).filter_map(|_| f()).fold(0.0f64, f64::max);
        let copy = best(&mut || copy_run(&mut src, &mut dst, tx_cpu));
        let remote = best(&mut || remote_read_run(&mut src, &mut dst, tx_cpu));
        let split = best(&mut || split_run(&mut src, &mut dst, tx_cpu));
        (copy, remote, split)
    });
    strait_sys::cpu::unpin(old);
    r
}

fn gbps(bytes: usize, secs: f64) -> Option<f64> {
    (secs > 0.0).then(|| bytes as f64 / secs / 1e9)
}

/// Writes the message as an application would before sending it (its lines then sit
/// dirty in the writing core's cache, as a sender's buffer does).
fn fill(buf: &mut [u8], round: usize) {
    buf.fill(round as u8 | 1);
}

/// The pipelined copy: a producer thread (which wrote the message) copies chunks
/// into a ring of [`SLOTS`] slots, the consumer (this thread) copies them out.
fn copy_run(src: &mut [u8], dst: &mut [u8], tx_cpu: Option<usize>) -> Option<f64> {
    let mut ring = vec![0u8; SLOTS * CHUNK];
    let ring_ptr = ring.as_mut_ptr() as usize;
    let chunks = RUN / CHUNK;
    let per_msg = MSG / CHUNK;
    let produced = AtomicU64::new(0);
    let consumed = AtomicU64::new(0);
    let started = AtomicU64::new(0);
    let mut t = None;
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(c) = tx_cpu {
                strait_sys::cpu::pin(c);
            }
            fill(src, 0);
            started.store(1, Ordering::Release);
            for i in 0..chunks {
                while (i as u64) >= consumed.load(Ordering::Acquire) + SLOTS as u64 {
                    std::hint::spin_loop();
                }
                let from = &src[(i % per_msg) * CHUNK..][..CHUNK];
                // SAFETY: slot `i % SLOTS` lies inside `ring`, which outlives the
                // scope; the consumer is done with it (consumed > i - SLOTS), and
                // only this thread writes it until it publishes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        from.as_ptr(),
                        (ring_ptr as *mut u8).add((i % SLOTS) * CHUNK),
                        CHUNK,
                    )
                };
                produced.store(i as u64 + 1, Ordering::Release);
            }
        });
        while started.load(Ordering::Acquire) == 0 {
            std::hint::spin_loop();
        }
        t = Some(Instant::now());
        for i in 0..chunks {
            while produced.load(Ordering::Acquire) <= i as u64 {
                std::hint::spin_loop();
            }
            let to = &mut dst[(i % per_msg) * CHUNK..][..CHUNK];
            // SAFETY: the producer published slot `i % SLOTS` (Acquire above) and
            // does not touch it again until we hand it back.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (ring_ptr as *const u8).add((i % SLOTS) * CHUNK),
                    to.as_mut_ptr(),
                    CHUNK,
                )
            };
            consumed.store(i as u64 + 1, Ordering::Release);
        }
    });
    drop(ring);
    gbps(RUN, t?.elapsed().as_secs_f64())
}

/// The remote read: another thread writes each message (as the sender's program
/// does), then this thread reads it whole with `process_vm_readv` (from this
/// process: the kernel pins the pages and copies on the reader's core, as for a
/// peer); only the reads are timed.
fn remote_read_run(src: &mut [u8], dst: &mut [u8], tx_cpu: Option<usize>) -> Option<f64> {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let addr = src.as_ptr() as u64;
    let mut secs = 0.0;
    for round in 0..RUN / MSG {
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Some(c) = tx_cpu {
                    strait_sys::cpu::pin(c);
                }
                fill(src, round)
            });
        });
        let t = Instant::now();
        // SAFETY: `dst` is valid for `MSG` bytes and `addr` is `src`, our own readable
        // memory, not borrowed mutably meanwhile (the writer thread has ended).
        unsafe { crate::sys::vm_read(me, addr, dst.as_mut_ptr(), MSG) }.ok()?;
        secs += t.elapsed().as_secs_f64();
    }
    gbps(RUN, secs)
}

/// The split transfer: the writing thread (one for the whole run, pinned to the
/// sender's CPU) writes each message, as the sender's program does; then, at this
/// thread's signal, it writes the message's second half into `dst` with
/// `process_vm_writev` while this thread reads the first half with
/// `process_vm_readv` (both on this process: what a peer costs). Timed from the
/// signal until both halves are in.
fn split_run(src: &mut [u8], dst: &mut [u8], tx_cpu: Option<usize>) -> Option<f64> {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let cut = MSG / 2;
    let rounds = (RUN / MSG) as u64;
    let (src_addr, dst_addr) = (src.as_mut_ptr() as usize, dst.as_mut_ptr() as usize);
    // Per round r (from 1): the writer sets `filled` to r, this thread `go` to r,
    // the writer `wrote` to r (or `u64::MAX` if its write failed).
    let (filled, go, wrote) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let mut secs = 0.0;
    let mut ok = true;
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(c) = tx_cpu {
                strait_sys::cpu::pin(c);
            }
            for r in 1..=rounds {
                // SAFETY: the reader touches `src` only between `filled` and `wrote`
                // of this round, and only reads it.
                fill(unsafe { std::slice::from_raw_parts_mut(src_addr as *mut u8, MSG) }, r as usize - 1);
                filled.store(r, Ordering::Release);
                while go.load(Ordering::Acquire) < r {
                    std::hint::spin_loop();
                }
                // SAFETY: the second halves of `src` (read) and `dst` (written by the
                // kernel) belong to this part alone; the reader takes the first halves.
                let res = unsafe {
                    crate::sys::vm_write(
                        me,
                        (dst_addr + cut) as u64,
                        (src_addr + cut) as *const u8,
                        MSG - cut,
                    )
                };
                if res.is_err() {
                    wrote.store(u64::MAX, Ordering::Release);
                    return;
                }
                wrote.store(r, Ordering::Release);
            }
        });
        for r in 1..=rounds {
            while filled.load(Ordering::Acquire) < r {
                if wrote.load(Ordering::Acquire) == u64::MAX {
                    ok = false;
                    return;
                }
                std::hint::spin_loop();
            }
            let t = Instant::now();
            go.store(r, Ordering::Release);
            // SAFETY: the first half of `dst` is this part's alone (see above).
            ok &= unsafe { crate::sys::vm_read(me, src_addr as u64, dst_addr as *mut u8, cut) }.is_ok();
            while wrote.load(Ordering::Acquire) < r {
                std::hint::spin_loop();
            }
            secs += t.elapsed().as_secs_f64();
            if wrote.load(Ordering::Acquire) == u64::MAX || !ok {
                ok = false;
                // Let a writer still waiting for this round go (it finds `go` past it).
                go.store(u64::MAX, Ordering::Release);
                return;
            }
        }
    });
    if !ok {
        return None;
    }
    gbps(RUN, secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_remote_read_needs_a_clear_margin() {
        assert_eq!(decide(7.1, 10.3, 0.0), RndvChoice::RemoteRead);
        assert_eq!(decide(14.0, 9.0, 0.0), RndvChoice::Copy);
        assert_eq!(decide(10.0, 10.4, 0.0), RndvChoice::Copy);
        assert_eq!(decide(10.0, 0.0, 0.0), RndvChoice::Copy);
        assert_eq!(decide(0.0, 0.0, 0.0), RndvChoice::Copy);
        // The split must beat both, each by the margin.
        assert_eq!(decide(9.0, 15.8, 46.0), RndvChoice::Split);
        assert_eq!(decide(9.0, 15.8, 16.0), RndvChoice::RemoteRead);
        assert_eq!(decide(20.0, 15.8, 20.5), RndvChoice::Copy);
        assert_eq!(decide(10.0, 0.0, 30.0), RndvChoice::Split);
    }

    /// A cache for host `h` in a fresh private folder for `tag`, and the folder.
    fn cache_in(tag: &str) -> (PathBuf, Cache) {
        use std::os::unix::fs::DirBuilderExt;
        let d = std::env::temp_dir().join(format!("strait-cal-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::DirBuilder::new().mode(0o700).create(&d).unwrap();
        let c = Cache::at(d.join("calibration"), "h".into());
        (d, c)
    }

    /// A measured calibration with these numbers.
    fn measured(choice: RndvChoice, copy_gbps: f64, remote_read_gbps: f64) -> Calibration {
        Calibration { choice, copy_gbps, remote_read_gbps, split_gbps: 0.0, source: Source::Measured }
    }

    /// Writes a cache file for host `h` by hand: `choice`, 9 and 1 GB/s, quiet.
    fn write_by_hand(c: &Cache, choice: &str) {
        std::fs::write(
            c.path(),
            format!(
                "host=h\nchoice={choice}\ncopy_gbps=9.0\nremote_read_gbps=1.0\nsplit_gbps=0.0\nquiet=1\nat=0\n"
            ),
        )
        .unwrap();
    }

    #[test]
    fn a_cache_round_trips_and_must_agree_with_the_rule() {
        let (d, cache) = cache_in("rt");
        let c = measured(RndvChoice::RemoteRead, 7.1, 10.3);
        store(&cache, &c, true).unwrap();
        let back = load(&cache).expect("valid cache");
        assert_eq!(
            (back.choice, back.copy_gbps, back.remote_read_gbps),
            (c.choice, c.copy_gbps, c.remote_read_gbps)
        );
        assert_eq!(back.source, Source::Cached(cache.path().to_owned()));
        write_by_hand(&cache, "copy");
        assert!(load(&cache).is_some());
        // A file that contradicts the rule (say, edited to force remote reads) is not
        // taken.
        write_by_hand(&cache, "remote-read");
        assert!(load(&cache).is_none(), "a cache contradicting its own numbers was trusted");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn both_paths_measure_and_move_the_bytes() {
        let mut src = vec![0u8; MSG];
        let mut dst = vec![0u8; MSG];
        assert!(copy_run(&mut src, &mut dst, None).is_some_and(|g| g > 0.0));
        assert!(dst.iter().all(|&b| b == 1), "the measured copy path did not move the bytes");
        dst.fill(0);
        if let Some(g) = remote_read_run(&mut src, &mut dst, None) {
            assert!(g > 0.0);
            assert_eq!(dst, src, "the measured remote read did not move the bytes");
            assert!(dst.iter().all(|&b| b == (RUN / MSG - 1) as u8 | 1), "not the last message");
        }
        dst.fill(0);
        if let Some(g) = split_run(&mut src, &mut dst, None) {
            assert!(g > 0.0);
            assert!(
                dst.iter().all(|&b| b == (RUN / MSG - 1) as u8 | 1),
                "the split did not move both halves"
            );
        }
    }
}
