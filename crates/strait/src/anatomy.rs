//! `strait anatomy` for strait's own path: a ping-pong over the shm device with the
//! stage probes on, analysed by [`strait_anatomy::stages`].
//!
//! The two ends are two threads of this process, each pinned to its own core, each
//! with its own [`Worker`] and [`ShmDevice`]: the data path (memfd rings, engine,
//! completion queue) is exactly the one two processes use, and both ends' probe
//! logs are at hand without shipping them between processes. The time-stamp counter
//! is invariant and shared by the cores, so the stamps of the two ends are on one
//! time line and cross-end stages (a frame's transfer) are measured directly, not
//! derived.
//!
//! Every size runs `rounds` pairs of batches: one with the probes switched on (its
//! stamps give the stages) and one with them off (its round trips give the
//! independently measured one-way latency the stage sum is checked against).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use strait_anatomy::anatomy::{AnatomyRun, StageRow};
use strait_anatomy::stages::{self, OneWay, STAGES};
use strait_anatomy::sys::{pin, unpin};
use strait_anatomy::Clock;
use strait_core::{Config, Device, EpId, MemoryRegion, OpKind, Status, Worker};
use strait_probe::Stamp;
use strait_shm::{ShmConfig, ShmDevice, ShmListener};
use thiserror::Error;

/// The transport name, as in `strait bench`.
pub const TRANSPORT: &str = "strait-shm";
const TAG_PING: u64 = 1;
const TAG_PONG: u64 = 2;
/// A poll loop gives up (the other end is presumed stuck) after this long.
const DEAD: Duration = Duration::from_secs(20);

/// Why strait's own anatomy could not be measured.
#[derive(Debug, Error)]
pub enum AnatomyError {
    /// This build has no probes in it.
    #[error(
        "this strait was built without stage probes; rebuild with \
         `cargo build --release -p strait --features probes`"
    )]
    ProbesCompiledOut,
    /// The stage stamps need an invariant, cross-core time-stamp counter.
    #[error(
        "no invariant TSC on this machine (clock source {0}): stage stamps of two cores cannot be compared"
    )]
    NoInvariantTsc(&'static str),
    /// Setting up the connection, memory or threads failed.
    #[error("setup: {0}")]
    Setup(String),
    /// An operation failed or an end stopped answering.
    #[error("ping-pong: {0}")]
    PingPong(String),
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct AnatomyConfig {
    /// Message sizes, bytes (each at least 1).
    pub sizes: Vec<u64>,
    /// Probed round trips per size (as many unprobed ones are measured).
    pub iters: u64,
    /// Unmeasured round trips per size first.
    pub warmup: u64,
    /// Pairs of (probed, unprobed) batches per size, interleaved.
    pub rounds: u32,
    /// Largest accepted |stage sum - measured| / measured.
    pub tolerance: f64,
}

/// The measured cost of one probe, in counter ticks, and of one compiled-in probe
/// that is switched off.
#[derive(Debug, Clone, Copy)]
pub struct ProbeCost {
    /// Ticks per recording probe (median of several runs of back-to-back probes).
    pub on_ticks: f64,
    /// Ticks per switched-off probe.
    pub off_ticks: f64,
}

/// Measures what one probe costs (its own log, then cleared; probes left off).
pub fn probe_cost() -> ProbeCost {
    const N: u64 = 4000;
    let run = |on: bool| {
        let mut v: Vec<f64> = (0..9)
            .map(|_| {
                strait_probe::start_log(N as usize + 8);
                strait_probe::set_enabled(on);
                let t0 = strait_probe::now();
                for _ in 0..N {
                    strait_probe::probe!(strait_probe::Stage::Mark);
                }
                let t1 = strait_probe::now();
                strait_probe::set_enabled(false);
                t1.saturating_sub(t0) as f64 / N as f64
            })
            .collect();
        strait_probe::clear_log();
        v.sort_unstable_by(f64::total_cmp);
        v[v.len() / 2]
    };
    ProbeCost { on_ticks: run(true), off_ticks: run(false) }
}

/// One end: a worker, its endpoint and buffers.
struct End<D: Device> {
    w: Worker<D>,
    ep: EpId,
    tx: MemoryRegion,
    rx: MemoryRegion,
}

fn region(len: usize) -> Result<MemoryRegion, AnatomyError> {
    let mut r =
        MemoryRegion::new(len.max(8)).map_err(|e| AnatomyError::Setup(format!("memory region: {e}")))?;
    r.bytes_mut().map_err(|e| AnatomyError::Setup(format!("memory region: {e}")))?.fill(0x5a);
    Ok(r)
}

impl<D: Device> End<D> {
    fn new(mut w: Worker<D>, dev: D) -> Result<End<D>, AnatomyError> {
        let ep = w.attach(dev);
        Ok(End { w, ep, tx: region(8)?, rx: region(8)? })
    }

    fn prepare(&mut self, size: usize) -> Result<(), AnatomyError> {
        if self.tx.len() < size {
            self.tx = region(size)?;
            self.rx = region(size)?;
        }
        Ok(())
    }

    fn post_recv(&mut self, size: usize, tag: u64) -> Result<(), AnatomyError> {
        self.w
            .post_recv(self.ep, &mut self.rx, 0..size, tag, u64::MAX, 0)
            .map_err(|e| AnatomyError::PingPong(format!("post_recv: {e}")))
    }

    fn post_send(&mut self, size: usize, tag: u64) -> Result<(), AnatomyError> {
        self.w
            .post_send(self.ep, &self.tx, 0..size, tag, 0)
            .map_err(|e| AnatomyError::PingPong(format!("post_send: {e}")))
    }

    /// Polls until `sends` send and `recvs` receive completions arrived; returns
    /// how many send completions beyond `sends` it consumed meanwhile.
    fn reap(&mut self, mut sends: u32, mut recvs: u32) -> Result<u32, AnatomyError> {
        let mut extra = 0;
        let mut stall = crate::bench::native::Stall::default();
        while sends > 0 || recvs > 0 {
            match self.w.poll() {
                Some(c) => {
                    if c.status != Status::Ok {
                        let why = match self.w.endpoint_error(self.ep) {
                            Some((_, Some(why))) => format!(" ({why})"),
                            _ => String::new(),
                        };
                        return Err(AnatomyError::PingPong(format!("{:?} ended {:?}{why}", c.op, c.status)));
                    }
                    match c.op {
                        OpKind::Send if sends == 0 => extra += 1,
                        OpKind::Send => sends -= 1,
                        OpKind::Recv => recvs = recvs.saturating_sub(1),
                    }
                }
                None => {
                    if stall.over(DEAD) {
                        return Err(AnatomyError::PingPong(format!("no completion within {DEAD:?}")));
                    }
                }
            }
        }
        Ok(extra)
    }
}

enum Cmd {
    Batch { size: usize, iters: u64, probes: bool, log: usize },
    Quit,
}

/// The engine settings of both ends: the environment's, with the rendezvous path
/// pinned to the pipelined copy unless `STRAIT_RNDV_MODE` says otherwise (the stage
/// map dissects that path; `auto` would follow the host's calibration).
fn engine_config() -> Result<Config, AnatomyError> {
    let mut cfg = Config::from_env().map_err(|e| AnatomyError::Setup(format!("config: {e}")))?;
    if std::env::var_os("STRAIT_RNDV_MODE").is_none() {
        cfg.rndv_mode = strait_core::RndvMode::Copy;
    }
    Ok(cfg)
}

/// Makes one end's connected device, on that end's thread, for its worker.
pub(crate) type MakeDevice<D> = Box<dyn FnOnce(&Worker<D>) -> Result<D, AnatomyError> + Send>;

/// The answering end's loop: one batch of pongs per command, its probe log back.
fn pong_thread<D: Device>(
    make: MakeDevice<D>,
    cmds: mpsc::Receiver<Cmd>,
    replies: mpsc::Sender<Result<Vec<Stamp>, String>>,
) -> Result<(), AnatomyError> {
    let _ = pin(1);
    let w = Worker::new(engine_config()?).map_err(|e| AnatomyError::Setup(format!("worker: {e}")))?;
    let dev = make(&w)?;
    let mut end = End::new(w, dev)?;
    while let Some(Cmd::Batch { size, iters, probes, log }) = next_command(&cmds, &mut end) {
        let r = (|| {
            end.prepare(size)?;
            if probes {
                strait_probe::start_log(log);
            }
            end.post_recv(size, TAG_PING)?;
            // Rendezvous sends complete while the next ping is awaited.
            let mut pending: u32 = 0;
            for i in 0..iters {
                pending -= end.reap(0, 1)?.min(pending);
                if i + 1 < iters {
                    end.post_recv(size, TAG_PING)?;
                }
                end.post_send(size, TAG_PONG)?;
                pending += 1;
            }
            end.reap(pending, 0)?;
            Ok::<_, AnatomyError>(if probes { strait_probe::take_log().0 } else { Vec::new() })
        })();
        let failed = r.is_err();
        if replies.send(r.map_err(|e| e.to_string())).is_err() || failed {
            break;
        }
    }
    Ok(())
}

/// The next command for the answering end. While it waits, a device with timers
/// running (the reliability layer's: the last sends' packets not yet all out
/// behind the congestion window, acknowledgements, retransmissions) is driven as
/// the benchmark peer drives it: a send completion hands the buffer back, it does
/// not mean the packets left, and a user-level stack moves only while polled.
fn next_command<D: Device>(cmds: &mpsc::Receiver<Cmd>, end: &mut End<D>) -> Option<Cmd> {
    loop {
        if end.w.next_timer_ns().is_none() {
            return cmds.recv().ok();
        }
        match cmds.recv_timeout(Duration::from_micros(100)) {
            Ok(c) => return Some(c),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                for _ in 0..64 {
                    if end.w.progress() == 0 {
                        break;
                    }
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return None,
        }
    }
}

/// Raw results of one size.
pub(crate) struct SizeData {
    pub(crate) size: u64,
    pub(crate) paths: Vec<OneWay>,
    /// Round-trip periods of the unprobed batches, ticks.
    pub(crate) periods: Vec<f64>,
    /// Round-trip periods of the probed batches, ticks.
    pub(crate) periods_probed: Vec<f64>,
    /// Round-trip periods of the batches with doubled probes, ticks.
    pub(crate) periods_double: Vec<f64>,
    pub(crate) dropped: u64,
}

/// Round-trip periods, this end's stamps, the other end's stamps, stamps dropped.
pub(crate) type BatchResult = (Vec<f64>, Vec<Stamp>, Vec<Stamp>, u64);

/// How a batch runs its probes (the numbers are the preload library's switch
/// positions, `strait_preload_probes_set`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probes {
    /// Off: the unprobed measurement the stage sum is checked against.
    Off = 0,
    /// On: the stages.
    On = 1,
    /// Every probe stamps twice (calibration of the in-situ probe cost).
    Double = 2,
}

impl Probes {
    /// Stamps a batch of `iters` round trips needs room for, at `per_iter` stamps
    /// per round trip and end (0: none, probes off).
    pub(crate) fn log_room(self, iters: u64, per_iter: usize) -> usize {
        match self {
            Probes::Off => 0,
            Probes::On => iters as usize * per_iter + 1024,
            Probes::Double => 2 * (iters as usize * per_iter + 1024),
        }
    }
}

/// One size's measurement: `warmup` unmeasured round trips, then `rounds` rounds of
/// a probed, a doubled and an unprobed batch (interleaved, so that a change in the
/// machine's state meets all three), `iters` probed round trips in all; `walk` turns
/// a probed batch's two logs into one-way paths.
pub(crate) fn measure_rounds<E>(
    size: u64,
    (warmup, iters, rounds): (u64, u64, u32),
    mut batch: impl FnMut(u64, Probes) -> Result<BatchResult, E>,
    walk: impl Fn(&[Stamp], &[Stamp]) -> Vec<OneWay>,
) -> Result<SizeData, E> {
    if warmup > 0 {
        batch(warmup, Probes::Off)?;
    }
    let rounds = u64::from(rounds.max(1));
    let per = iters.div_ceil(rounds).max(2);
    let mut d = SizeData {
        size,
        paths: Vec::new(),
        periods: Vec::new(),
        periods_probed: Vec::new(),
        periods_double: Vec::new(),
        dropped: 0,
    };
    for _ in 0..rounds {
        let (periods, a, b, dropped) = batch(per, Probes::On)?;
        d.paths.extend(walk(&a, &b));
        d.periods_probed.extend(periods);
        d.dropped += dropped;
        let (periods, _, _, _) = batch(per, Probes::Double)?;
        d.periods_double.extend(periods);
        let (periods, _, _, _) = batch(per, Probes::Off)?;
        d.periods.extend(periods);
    }
    Ok(d)
}

/// The pinging end's side of one batch: returns the round-trip periods (ticks
/// between consecutive `post_send` calls).
fn ping_batch<D: Device>(end: &mut End<D>, size: usize, iters: u64) -> Result<Vec<f64>, AnatomyError> {
    let mut ts = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        end.post_recv(size, TAG_PONG)?;
        ts.push(strait_probe::now());
        end.post_send(size, TAG_PING)?;
        end.reap(1, 1)?;
    }
    Ok(ts.windows(2).map(|w| w[1].saturating_sub(w[0]) as f64).collect())
}

/// Runs the anatomy of strait's shm path for every size; returns the runs and
/// notes. `progress` is told each size as it starts.
pub fn run(
    cfg: &AnatomyConfig,
    clock: &Clock,
    cost: ProbeCost,
    progress: &mut dyn FnMut(u64),
) -> Result<(Vec<AnatomyRun>, Vec<String>), AnatomyError> {
    check_probes(clock)?;
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!("strait-anatomy-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    let listener = ShmListener::bind(&name).map_err(|e| AnatomyError::Setup(format!("bind: {e}")))?;
    let pong: MakeDevice<ShmDevice> = Box::new(move |w| {
        ShmDevice::connect(&name, &ShmConfig::default(), w.notifier())
            .map_err(|e| AnatomyError::Setup(format!("connect: {e}")))
    });
    let ping: MakeDevice<ShmDevice> = Box::new(move |w| {
        listener.accept(w.notifier()).map_err(|e| AnatomyError::Setup(format!("accept: {e}")))
    });
    run_pair(TRANSPORT, &STAGES, cfg, clock, cost, progress, ping, pong)
}

/// Fails early when the stage stamps cannot be taken or compared across cores.
pub(crate) fn check_probes(clock: &Clock) -> Result<(), AnatomyError> {
    if !strait_probe::COMPILED {
        return Err(AnatomyError::ProbesCompiledOut);
    }
    if cfg!(target_arch = "x86_64") && clock.tsc_ghz().is_none() {
        return Err(AnatomyError::NoInvariantTsc(clock.source().name()));
    }
    Ok(())
}

/// The ping-pong of strait's native API between two threads of this process, each
/// with its own worker and the device `ping` or `pong` makes on its thread (the
/// answering end's thread is started first), dissected along the stages `defs`
/// names (the chain of [`stages::walk`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_pair<D: Device + 'static>(
    transport: &str,
    defs: &[stages::StageDef],
    cfg: &AnatomyConfig,
    clock: &Clock,
    cost: ProbeCost,
    progress: &mut dyn FnMut(u64),
    ping: MakeDevice<D>,
    pong: MakeDevice<D>,
) -> Result<(Vec<AnatomyRun>, Vec<String>), AnatomyError> {
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let (rep_tx, rep_rx) = mpsc::channel();
    let peer = std::thread::Builder::new()
        .name("anatomy-pong".into())
        .spawn(move || pong_thread(pong, cmd_rx, rep_tx))
        .map_err(|e| AnatomyError::Setup(format!("thread: {e}")))?;
    let two_cores = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    let old_cpus = if two_cores { pin(0) } else { None };
    let result = (|| {
        let w = Worker::new(engine_config()?).map_err(|e| AnatomyError::Setup(format!("worker: {e}")))?;
        let dev = ping(&w)?;
        let mut end = End::new(w, dev)?;
        let mut data = Vec::new();
        for &size in &cfg.sizes {
            progress(size);
            data.push(measure_size(&mut end, size as usize, cfg, &cmd_tx, &rep_rx)?);
        }
        Ok::<_, AnatomyError>(data)
    })();
    unpin(old_cpus);
    let _ = cmd_tx.send(Cmd::Quit);
    drop(cmd_tx);
    let peer_result = peer.join().map_err(|_| AnatomyError::PingPong("the pong thread panicked".into()))?;
    let data = match (result, peer_result) {
        (Ok(d), _) => d,
        (Err(e), Err(pe)) => return Err(AnatomyError::PingPong(format!("{e} (pong end: {pe})"))),
        (Err(e), Ok(())) => return Err(e),
    };
    let tpn = clock.ticks_per_ns();
    let mut runs = Vec::new();
    let mut notes = Vec::new();
    for d in data {
        match report_size(transport, defs, &d, cost.on_ticks, tpn, cfg.tolerance, &mut notes) {
            Some(r) => runs.push(r),
            None => notes.push(format!("{transport} {} B: no complete probed path was recorded", d.size)),
        }
    }
    Ok((runs, notes))
}

/// One size's report row from its paths and batches: the stage means (probe cost
/// calibrated in situ: probed minus unprobed round trips per probe on the path, with
/// `fallback_probe_ticks` when that cannot be computed), the doorbell beside the
/// chain, and the check against the unprobed one-way time. `None` without a single
/// complete path. `defs` names the stages of the walked chain.
pub(crate) fn report_size(
    transport: &str,
    defs: &[stages::StageDef],
    d: &SizeData,
    fallback_probe_ticks: f64,
    tpn: f64,
    tolerance: f64,
    notes: &mut Vec<String>,
) -> Option<AnatomyRun> {
    // What one probe costs on this path: the one-way time with probes on minus
    // with them off, per probe on the path (probes overlap the work around them,
    // so this is less than a back-to-back probe costs).
    let per_path = stages::probes_per_path(&d.paths);
    let growth = |more: &[f64], less: &[f64]| match (stages::kept_mean(more), stages::kept_mean(less)) {
        (Some(m), Some(l)) if per_path > 0.0 => Some(((m - l) / 2.0 / per_path).max(0.0)),
        _ => None,
    };
    let in_situ = growth(&d.periods_probed, &d.periods).unwrap_or(fallback_probe_ticks);
    // Independently of the unprobed runs: what one more probe at every point
    // costs (a second, back-to-back stamp: an upper estimate).
    let doubled = growth(&d.periods_double, &d.periods_probed).unwrap_or(fallback_probe_ticks);
    let s = stages::summarize(&d.paths, tpn, in_situ)?;
    if d.dropped > 0 {
        notes.push(format!("{transport} {} B: {} probe stamps dropped (log full)", d.size, d.dropped));
    }
    let one_way: Vec<f64> = d.periods.iter().map(|p| p / 2.0 / tpn).collect();
    let measured = stages::kept_mean(&one_way).unwrap_or(f64::NAN);
    let mut rows: Vec<StageRow> = s
        .stages
        .iter()
        .filter_map(|st| {
            let def = defs.get(st.stage?)?;
            Some(StageRow {
                name: def.name.into(),
                layer: def.layer.into(),
                ns: st.mean_ns,
                p50_ns: st.p50_ns,
                p99_ns: st.p99_ns,
                cycles: st.mean_ns * tpn,
                on_critical_path: true,
                raw_ns: None,
            })
        })
        .collect();
    if let Some(db) = &s.doorbell {
        rows.push(StageRow {
            name: stages::DOORBELL.name.into(),
            layer: stages::DOORBELL.layer.into(),
            ns: db.mean_ns,
            p50_ns: db.p50_ns,
            p99_ns: db.p99_ns,
            cycles: db.mean_ns * tpn,
            on_critical_path: false,
            raw_ns: None,
        });
    }
    let deviation = (s.corrected_ns - measured) / measured;
    let independent = stages::summarize(&d.paths, tpn, doubled).map_or(f64::NAN, |x| x.corrected_ns);
    Some(AnatomyRun {
        transport: transport.into(),
        size_bytes: d.size,
        measured_one_way_ns: measured,
        stage_sum_ns: s.corrected_ns,
        total_p50_ns: s.p50_ns,
        probed_one_way_ns: s.raw_ns,
        probe_overhead_ns: s.probe_ns,
        probe_cost_ns: in_situ / tpn,
        probe_cost_doubled_ns: Some(doubled / tpn),
        deviation_doubled: Some((independent - measured) / measured),
        deviation,
        within_tolerance: strait_anatomy::anatomy::agrees(s.corrected_ns, measured, tolerance),
        samples: s.paths,
        stages: rows,
        wake_modes: None,
    })
}

fn measure_size<D: Device>(
    end: &mut End<D>,
    size: usize,
    cfg: &AnatomyConfig,
    cmds: &mpsc::Sender<Cmd>,
    replies: &mpsc::Receiver<Result<Vec<Stamp>, String>>,
) -> Result<SizeData, AnatomyError> {
    end.prepare(size)?;
    let gone = || AnatomyError::PingPong("the pong thread stopped".into());
    let mut batch = |iters: u64, mode: Probes| -> Result<BatchResult, AnatomyError> {
        // Room for every stamp of a batch (a 1 MiB rendezvous takes a few dozen per
        // round trip and end; a network device stamps every data packet it
        // receives, at least 1 KiB each but the last); allocated here, outside the
        // measured loop.
        let log = mode.log_room(iters, 24 + 4 * size.div_ceil(64 << 10) + size.div_ceil(1 << 10));
        let probes = mode != Probes::Off;
        if probes {
            strait_probe::start_log(log);
        }
        strait_probe::set_double(mode == Probes::Double);
        strait_probe::set_enabled(probes);
        cmds.send(Cmd::Batch { size, iters, probes, log }).map_err(|_| gone())?;
        let periods = ping_batch(end, size, iters);
        let theirs = replies.recv().map_err(|_| gone());
        strait_probe::set_enabled(false);
        strait_probe::set_double(false);
        let periods = periods?;
        let theirs = theirs?.map_err(AnatomyError::PingPong)?;
        let (mine, dropped) = if probes { strait_probe::take_log() } else { (Vec::new(), 0) };
        Ok((periods, mine, theirs, dropped))
    };
    measure_rounds(size as u64, (cfg.warmup, cfg.iters, cfg.rounds), &mut batch, stages::walk)
}
