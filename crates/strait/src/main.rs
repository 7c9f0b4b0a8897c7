//! The `strait` command.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

mod model;
mod run;

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use strait_anatomy::harness::{self, BenchConfig, Peer, PeerLauncher, Progress};
use strait_anatomy::kernel;
use strait_anatomy::report::{compact_stamp, render_svg, render_table, rfc3339};
use strait_anatomy::size::{format_size, parse_size_list};
use strait_anatomy::sys::SyscallCounter;
use strait_anatomy::{BenchError, BenchReport, Clock, MachineInfo, TransportInfo};

/// strait: a user-level communication stack.
#[derive(Debug, Parser)]
#[command(name = "strait", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Measure strait's shared-memory path against the kernel's paths and the
    /// machine's physical floor, side by side in one run.
    Bench(BenchArgs),
    /// Break one message's latency down stage by stage (API, engine, device, ring
    /// transfer, match, copy, completion) per message size, with cycle-counter probes.
    Anatomy(AnatomyArgs),
    /// Run a program with its local TCP connections to other `strait run` processes
    /// carried over shared memory (LD_PRELOAD of libstrait_preload.so; no change to
    /// the program).
    Run(run::RunArgs),
    /// The analytical model: fit per-layer costs, check predictions against
    /// measurements, predict what-if machines (docs/MODEL.md).
    Model(model::ModelArgs),
    /// Internal: the driver's end of the `strait-run` benchmark transport, under
    /// the preload library.
    #[command(name = "__bench-run-end", hide = true)]
    BenchRunEnd,
    /// Both ends of `strait anatomy`'s strait-run ping-pong, under the preload library.
    #[command(name = "__anatomy-run-end", hide = true)]
    AnatomyRunEnd,
    /// Internal: the peer process of one benchmark transport.
    #[command(name = "__bench-peer", hide = true)]
    BenchPeer {
        /// Transport name.
        transport: String,
        /// Number of inherited descriptors (at fds 3, 4, ...).
        nfds: usize,
        /// Transport-specific arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    /// Human-readable tables.
    Table,
    /// One JSON document on stdout.
    Json,
}

/// A comma-separated size list flag.
#[derive(Debug, Clone)]
struct SizeList(Vec<u64>);

fn sizes(text: &str) -> Result<SizeList, String> {
    let v = parse_size_list(text).map_err(|e| e.to_string())?;
    if v.contains(&0) {
        return Err("sizes must be at least 1 byte".into());
    }
    Ok(SizeList(v))
}

#[derive(Debug, Args)]
struct BenchArgs {
    /// Output format on stdout.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Most warm-up iterations per transport and size (also capped at half a batch's time).
    #[arg(long, default_value_t = 1000)]
    warmup: u64,
    /// Most ping-pong iterations per latency batch.
    #[arg(long, default_value_t = 20_000)]
    iters: u64,
    /// Most messages per bandwidth batch.
    #[arg(long, default_value_t = 100_000)]
    bw_msgs: u64,
    /// Interleaved rounds per size (each round runs one batch on every transport).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Target duration of one batch in milliseconds (iterations are sized to fit).
    #[arg(long, default_value_t = 40.0)]
    batch_ms: f64,
    /// Iterations of the separate syscall-counting pass per cell (0 = do not count).
    #[arg(long, default_value_t = 200)]
    count_iters: u64,
    /// Ping-pong message sizes (K/M/G suffixes are binary).
    #[arg(long, default_value = "8,64,512,4K,32K,256K,1M", value_parser = sizes)]
    lat_sizes: SizeList,
    /// Streaming message sizes.
    #[arg(long, default_value = "1K,4K,16K,64K,256K,1M,4M", value_parser = sizes)]
    bw_sizes: SizeList,
    /// Transports to compare, comma-separated (default: all; see --list-transports).
    #[arg(long, value_delimiter = ',')]
    transports: Option<Vec<String>>,
    /// Directory under which bench-<UTC timestamp>/ is created.
    #[arg(long, default_value = "results")]
    out: PathBuf,
    /// Busy-poll the kernel transports (O_NONBLOCK and retry) instead of blocking.
    #[arg(long)]
    kernel_spin: bool,
    /// Never draw a progress bar (it is drawn only when stderr is a terminal).
    #[arg(long)]
    no_progress: bool,
    /// List the transports and exit.
    #[arg(long)]
    list_transports: bool,
    /// Run between two network namespaces joined by a veth pair (created for the run
    /// and removed after; needs root): transports kernel-tcp, kernel-udp,
    /// strait-udp, strait-xdp by default.
    #[arg(long)]
    across_netns: bool,
}

#[derive(Debug, Args)]
struct AnatomyArgs {
    /// Output format on stdout.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Message sizes (K/M/G suffixes are binary).
    #[arg(long, default_value = "4,64,512,4K,32K,256K,1M", value_parser = sizes)]
    sizes: SizeList,
    /// Probed round trips per size (as many more run with the probes off, to measure
    /// the one-way latency the stage sum is checked against).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(2..))]
    iters: u64,
    /// Unmeasured round trips per size first.
    #[arg(long, default_value_t = 200)]
    warmup: u64,
    /// Interleaved pairs of probed and unprobed batches per size.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Largest accepted deviation of the stage sum from the measured one-way latency.
    #[arg(long, default_value_t = 0.10)]
    tolerance: f64,
    /// Paths to dissect, comma-separated: strait-shm, strait-run, strait-run-udp,
    /// kernel-udp, kernel-tcp (default strait-shm,kernel-udp,kernel-tcp); with
    /// --across-netns strait-udp, strait-xdp, kernel-udp, kernel-tcp (default all
    /// four). The kernel paths need root (tracefs); they and strait-run-udp run only
    /// sizes up to 32K. strait-run and strait-run-udp need libstrait_preload.so built
    /// with its probes (`cargo build --release -p strait-preload --features
    /// probes`), found as `strait run` finds it (--preload, STRAIT_PRELOAD_LIB,
    /// beside strait).
    #[arg(long, value_delimiter = ',')]
    transports: Vec<String>,
    /// Dissect the paths between two network namespaces joined by veth pairs
    /// (created for the run and removed after; needs root) instead of on one host:
    /// strait's udp and xdp devices and the kernel's UDP and TCP, the stages of the
    /// kernel's path on both sides of the wire included.
    #[arg(long)]
    across_netns: bool,
    /// Directory under which anatomy-<UTC timestamp>/ is created.
    #[arg(long, default_value = "results")]
    out: PathBuf,
    /// The preload library for the strait-run path (default: STRAIT_PRELOAD_LIB,
    /// else libstrait_preload.so beside strait).
    #[arg(long)]
    preload: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Cmd::Anatomy(args) => return anatomy(args),
        Cmd::AnatomyRunEnd => return strait::run_anatomy::child_main(),
        Cmd::Run(args) => return run::run(args),
        Cmd::Model(args) => return model::run(args),
        Cmd::Bench(args) => bench(args),
        Cmd::BenchPeer { transport, nfds, args } => peer(&transport, nfds, &args),
        Cmd::BenchRunEnd => strait::bench::run::helper_main(),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strait: {e}");
            ExitCode::FAILURE
        }
    }
}

fn peer(transport: &str, nfds: usize, args: &[String]) -> Result<(), BenchError> {
    if std::env::var(kernel::BUSY_POLL_ENV).is_ok_and(|v| v == "1") {
        kernel::set_busy_poll(true);
    }
    let spec = strait::bench::select(&[transport.to_owned()])?;
    harness::peer_main(spec[0], nfds, args)
}

/// The start of a command line that reproduces a run: the `STRAIT_*` environment
/// that configures the engine (less `skip`, which the command sets itself), sorted
/// and quoted, then this program's path.
fn repro_prefix(skip: &[&str]) -> Vec<String> {
    let mut env: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("STRAIT_") && !skip.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}={}", shell_quote(&v)))
        .collect();
    env.sort();
    env.push(shell_quote(&std::env::args().next().unwrap_or_else(|| "strait".into())));
    env
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./,=:+@%".contains(c)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The command line that reproduces this run: every setting explicit, plus the
/// `STRAIT_*` environment that configures the engine.
fn repro_command(a: &BenchArgs, transports: &[String]) -> String {
    let set_by_run = [strait_anatomy::kernel::NET_ENV, strait::bench::xdp::XDP_ENV];
    let join = |v: &[u64]| v.iter().map(|&s| format_size(s)).collect::<Vec<_>>().join(",");
    let mut parts = repro_prefix(&set_by_run);
    parts.push("bench".into());
    parts.push(format!("--format {}", if a.format == Format::Json { "json" } else { "table" }));
    parts.push(format!("--warmup {}", a.warmup));
    parts.push(format!("--iters {}", a.iters));
    parts.push(format!("--bw-msgs {}", a.bw_msgs));
    parts.push(format!("--rounds {}", a.rounds));
    parts.push(format!("--batch-ms {}", a.batch_ms));
    parts.push(format!("--count-iters {}", a.count_iters));
    if a.kernel_spin {
        parts.push("--kernel-spin".into());
    }
    if a.across_netns {
        parts.push("--across-netns".into());
    }
    parts.push(format!("--lat-sizes {}", join(&a.lat_sizes.0)));
    parts.push(format!("--bw-sizes {}", join(&a.bw_sizes.0)));
    parts.push(format!("--transports {}", transports.join(",")));
    parts.push(format!("--out {}", shell_quote(&a.out.to_string_lossy())));
    parts.join(" ")
}

fn write_file(path: &Path, text: &str) -> Result<(), BenchError> {
    std::fs::write(path, text).map_err(|e| BenchError::Output { path: path.display().to_string(), source: e })
}

/// `out/<kind>-<stamp>`, with a numeric suffix if that already exists.
fn result_dir(out: &Path, kind: &str, stamp: &str) -> Result<PathBuf, BenchError> {
    std::fs::create_dir_all(out)
        .map_err(|e| BenchError::Output { path: out.display().to_string(), source: e })?;
    for n in 0..1000 {
        let name = if n == 0 { format!("{kind}-{stamp}") } else { format!("{kind}-{stamp}-{n}") };
        let dir = out.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(BenchError::Output { path: dir.display().to_string(), source: e }),
        }
    }
    Err(BenchError::Output {
        path: out.display().to_string(),
        source: std::io::Error::new(std::io::ErrorKind::AlreadyExists, "too many runs in one second"),
    })
}

/// Prints a report on stdout as JSON or as a table, and says where its files went and
/// how to reproduce it (on stderr for JSON, so stdout stays one document).
fn print_report(
    format: Format,
    json: &str,
    table: impl FnOnce() -> String,
    json_path: &Path,
    svg_path: &Path,
    command: &str,
) -> Result<(), BenchError> {
    let mut stdout = std::io::stdout().lock();
    let io = |e| BenchError::io("write stdout", e);
    match format {
        Format::Json => {
            writeln!(stdout, "{json}").map_err(io)?;
            eprintln!("wrote {} and {}", json_path.display(), svg_path.display());
            eprintln!("reproduce with: {command}");
        }
        Format::Table => {
            write!(stdout, "{}", table()).map_err(io)?;
            writeln!(stdout, "\nwrote {} and {}", json_path.display(), svg_path.display()).map_err(io)?;
            writeln!(stdout, "reproduce with: {command}").map_err(io)?;
        }
    }
    Ok(())
}

/// Creates the namespace pair, moves this thread (the driver) into the first, and
/// makes peers start in the second; both ends learn the addresses by environment.
fn across_netns(launcher: &mut PeerLauncher) -> Result<strait::netns::VethPair, BenchError> {
    let pair = strait::netns::VethPair::create("strb").map_err(|e| BenchError::Protocol(e.to_string()))?;
    let [d, p] = &pair.ends;
    let vars = [
        (strait_anatomy::kernel::NET_ENV, format!("{},{}", d.ip, p.ip)),
        (strait::bench::xdp::XDP_ENV, {
            let [rd, rp] = &pair.raw;
            format!("{},{},{},{}", rd.ifname, rd.mac, rp.ifname, rp.mac)
        }),
    ];
    for (k, v) in &vars {
        // Set before any thread of ours reads the environment.
        std::env::set_var(k, v);
        launcher.env.push((k.to_string(), v.clone()));
    }
    pair.enter(0).map_err(|e| BenchError::Protocol(e.to_string()))?;
    let exe = std::env::current_exe().map_err(|e| BenchError::io("locate the strait binary", e))?;
    launcher.exe = "ip".into();
    launcher.prefix =
        vec!["netns".into(), "exec".into(), p.ns.clone(), exe.display().to_string(), "__bench-peer".into()];
    Ok(pair)
}

fn bench(a: BenchArgs) -> Result<(), BenchError> {
    if a.list_transports {
        for s in strait::bench::specs().into_iter().chain(strait::bench::across_specs()) {
            println!("{:<12} {}", s.name(), s.description());
        }
        return Ok(());
    }
    if !(a.batch_ms > 0.0 && a.batch_ms.is_finite()) {
        return Err(BenchError::Protocol("--batch-ms must be a positive number".into()));
    }
    let names: Vec<String> = match &a.transports {
        Some(v) => v.iter().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect(),
        None if a.across_netns => strait::bench::across_specs().iter().map(|s| s.name().to_owned()).collect(),
        None => strait::bench::specs().iter().map(|s| s.name().to_owned()).collect(),
    };
    let specs = strait::bench::select(&names)?;
    let started = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let command = repro_command(&a, &names);
    let cfg = BenchConfig {
        warmup: a.warmup,
        iters: a.iters.max(1),
        bw_msgs: a.bw_msgs.max(1),
        rounds: a.rounds,
        batch_ms: a.batch_ms,
        count_iters: a.count_iters,
        lat_sizes: a.lat_sizes.0.clone(),
        bw_sizes: a.bw_sizes.0.clone(),
    };

    let clock = Clock::new();
    let (counter, counter_desc) = if a.count_iters == 0 {
        (None, "not counted (--count-iters 0)".to_owned())
    } else {
        match SyscallCounter::open() {
            Ok(c) => (Some(c), "perf_event_open on raw_syscalls:sys_enter, per process".to_owned()),
            Err(e) => {
                eprintln!("strait bench: syscalls per message will be null: {e}");
                (None, format!("unavailable: {e}"))
            }
        }
    };

    let show_bar = !a.no_progress && std::io::stderr().is_terminal();
    let bar = if show_bar {
        let b = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        if let Ok(style) = ProgressStyle::with_template("{elapsed:>4} [{bar:30}] {pos}/{len} {msg}") {
            b.set_style(style.progress_chars("=> "));
        }
        Some(b)
    } else {
        None
    };
    let warn = |bar: &Option<ProgressBar>, msg: &str| match bar {
        Some(b) => b.suspend(|| eprintln!("strait bench: {msg}")),
        None => eprintln!("strait bench: {msg}"),
    };

    let mut launcher = PeerLauncher::default();
    // Kept until the report is written; dropping it removes the namespaces.
    let _netns = if a.across_netns { Some(across_netns(&mut launcher)?) } else { None };
    if a.kernel_spin {
        kernel::set_busy_poll(true);
        launcher.env.push((kernel::BUSY_POLL_ENV.to_owned(), "1".to_owned()));
    }
    let mut peers: Vec<Option<Peer>> = Vec::with_capacity(specs.len());
    for s in &specs {
        match Peer::spawn(*s, &launcher) {
            Ok(p) => peers.push(Some(p)),
            Err(e) => {
                warn(&bar, &format!("{}: cannot start: {e}", s.name()));
                peers.push(None);
            }
        }
    }
    let mut on_progress = |p: Progress| match p {
        Progress::Total(n) => {
            if let Some(b) = &bar {
                b.set_length(n);
            }
        }
        Progress::Step(n, msg) => {
            if let Some(b) = &bar {
                b.set_position(n);
                b.set_message(msg);
            }
        }
        Progress::Warn(msg) => warn(&bar, &msg),
    };
    let mut results = harness::run(&cfg, &specs, &mut peers, &clock, counter.as_ref(), &mut on_progress);
    for p in peers.into_iter().flatten() {
        p.shutdown();
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    // Transports that never started still get (empty) rows saying why.
    for r in &mut results {
        if r.samples == 0 && r.note.is_none() {
            r.note = Some("no measurement".into());
        }
    }

    let machine = MachineInfo::collect(&clock, rfc3339(started), command.clone(), counter_desc);
    let transports = specs
        .iter()
        .map(|s| TransportInfo {
            name: s.name().to_owned(),
            description: s.description().to_owned(),
            busy_poll: s.polls(),
            settings: s.settings(),
        })
        .collect();
    let report = BenchReport { machine, results, transports };
    let json = report.to_json();
    let dir = result_dir(&a.out, "bench", &compact_stamp(started))?;
    let json_path = dir.join("bench.json");
    let svg_path = dir.join("bench.svg");
    write_file(&json_path, &json)?;
    write_file(&svg_path, &render_svg(&report))?;

    print_report(a.format, &json, || render_table(&report), &json_path, &svg_path, &command)
}

/// Exit status of `strait anatomy` when a requested path could not be measured
/// (strait's: probes compiled out, no invariant TSC, a failed ping-pong; the
/// kernel's: no tracefs, no permission, a missing tracepoint); the report, with
/// the reason in its notes, is still written.
const ANATOMY_PARTIAL: u8 = 3;

/// Largest message the kernel paths are dissected at (UDP datagrams stay below
/// 64K; the issue asks for 4 B to 32 KiB).
const KERNEL_MAX_SIZE: u64 = 32 << 10;

fn anatomy(a: AnatomyArgs) -> ExitCode {
    match anatomy_run(a) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(ANATOMY_PARTIAL),
        Err(e) => {
            eprintln!("strait anatomy: {e}");
            ExitCode::FAILURE
        }
    }
}

fn anatomy_command(a: &AnatomyArgs) -> String {
    let sizes = a.sizes.0.iter().map(|&s| format_size(s)).collect::<Vec<_>>().join(",");
    let mut parts = repro_prefix(&[]);
    parts.push("anatomy".into());
    parts.push(format!("--format {}", if a.format == Format::Json { "json" } else { "table" }));
    parts.push(format!("--sizes {sizes}"));
    parts.push(format!("--iters {} --warmup {} --rounds {}", a.iters, a.warmup, a.rounds));
    parts.push(format!("--tolerance {}", a.tolerance));
    parts.push(format!("--transports {}", a.transports.join(",")));
    if a.across_netns {
        parts.push("--across-netns".into());
    }
    parts.push(format!("--out {}", shell_quote(&a.out.to_string_lossy())));
    if let Some(p) = &a.preload {
        parts.push(format!("--preload {}", shell_quote(&p.to_string_lossy())));
    }
    parts.join(" ")
}

/// Adds one of strait's paths' runs and notes to the report, or, when it could not
/// be measured, says why (stderr and notes); whether it was measured.
fn absorb(
    name: &str,
    r: Result<(Vec<strait_anatomy::anatomy::AnatomyRun>, Vec<String>), strait::anatomy::AnatomyError>,
    runs: &mut Vec<strait_anatomy::anatomy::AnatomyRun>,
    notes: &mut Vec<String>,
) -> bool {
    match r {
        Ok((r, n)) => {
            runs.extend(r);
            notes.extend(n);
            true
        }
        Err(e) => {
            eprintln!("strait anatomy: {name}: {e}");
            notes.push(format!("{name}: not measured: {e}"));
            false
        }
    }
}

/// Runs the anatomy; `Ok(false)` when strait's own stages are missing.
fn anatomy_run(mut a: AnatomyArgs) -> Result<bool, BenchError> {
    use strait::anatomy::{self as anat, AnatomyConfig};
    use strait_anatomy::anatomy::{
        render_latency_svg, render_svg as anatomy_svg, render_table as anatomy_table, AnatomyReport,
    };
    use strait_anatomy::kanatomy;
    if !(a.tolerance >= 0.0 && a.tolerance.is_finite()) {
        return Err(BenchError::Protocol("--tolerance must be a non-negative number".into()));
    }
    use strait::across_anatomy as across;
    use strait::run_anatomy::{self as run_anat, Proto as RunProto};
    let known: &[&str] = if a.across_netns {
        &[across::UDP, across::XDP, "kernel-udp", "kernel-tcp"]
    } else {
        &[anat::TRANSPORT, run_anat::TRANSPORT, run_anat::TRANSPORT_UDP, "kernel-udp", "kernel-tcp"]
    };
    if a.transports.is_empty() {
        let default: &[&str] =
            if a.across_netns { known } else { &[anat::TRANSPORT, "kernel-udp", "kernel-tcp"] };
        a.transports = default.iter().map(|t| t.to_string()).collect();
    }
    if let Some(bad) = a.transports.iter().find(|t| !known.contains(&t.as_str())) {
        let mode = if a.across_netns { " with --across-netns" } else { "" };
        return Err(BenchError::UnknownTransport { name: format!("{bad}{mode}"), known: known.join(", ") });
    }
    let started = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let command = anatomy_command(&a);
    let clock = Clock::new();
    // Before any measuring thread is pinned (which would hide the other cores).
    let machine = MachineInfo::collect(&clock, rfc3339(started), command.clone(), "not counted".into());
    let cost = anat::probe_cost();
    let tpn = clock.ticks_per_ns();
    let cfg = AnatomyConfig {
        sizes: a.sizes.0.clone(),
        iters: a.iters,
        warmup: a.warmup,
        rounds: a.rounds,
        tolerance: a.tolerance,
    };
    let mut notes = Vec::new();
    let mut complete = true;
    let mut progress = |size: u64| {
        if std::io::stderr().is_terminal() {
            eprint!("\rstrait anatomy: {} {}   ", anat::TRANSPORT, format_size(size));
        }
    };
    let want = |t: &str| a.transports.iter().any(|x| x == t);
    // Removed when the anatomy ends (also on an error return).
    let veth = if a.across_netns {
        let pair =
            strait::netns::VethPair::create("stan").map_err(|e| BenchError::Protocol(e.to_string()))?;
        notes.push(format!(
            "across two network namespaces ({} {}, {} {}) joined by veth pairs, not loopback",
            pair.ends[0].ns, pair.ends[0].ip, pair.ends[1].ns, pair.ends[1].ip
        ));
        Some(pair)
    } else {
        None
    };
    let shm = if want(anat::TRANSPORT) {
        anat::run(&cfg, &clock, cost, &mut progress)
    } else {
        Ok((Vec::new(), Vec::new()))
    };
    let mut runs = match shm {
        Ok((runs, n)) => {
            notes.extend(n);
            if strait_probe::COMPILED {
                notes.push(format!(
                    "a compiled-in probe switched off costs {:.2} ns ({:.1} cycles); plain builds compile the probes out",
                    cost.off_ticks / tpn,
                    cost.off_ticks
                ));
            }
            runs
        }
        Err(e) => {
            eprintln!("strait anatomy: {}: {e}", anat::TRANSPORT);
            notes.push(format!("{}: not measured: {e}", anat::TRANSPORT));
            complete = false;
            Vec::new()
        }
    };
    for proto in [RunProto::Tcp, RunProto::Udp] {
        let name = proto.name();
        if !want(name) {
            continue;
        }
        let mut rcfg = cfg.clone();
        if proto == RunProto::Udp {
            rcfg.sizes.retain(|&s| s <= run_anat::UDP_MAX_SIZE);
            let skipped: Vec<String> =
                cfg.sizes.iter().filter(|&&s| s > run_anat::UDP_MAX_SIZE).map(|&s| format_size(s)).collect();
            if !skipped.is_empty() {
                notes.push(format!("{name}: sizes above 32K not dissected: {}", skipped.join(", ")));
            }
            if rcfg.sizes.is_empty() {
                continue;
            }
        }
        if std::io::stderr().is_terminal() {
            eprint!("\rstrait anatomy: {name}            ");
        }
        let r = strait::preload::find_lib(a.preload.clone())
            .map_err(strait::anatomy::AnatomyError::Setup)
            .and_then(|lib| run_anat::run(proto, &rcfg, &clock, &lib));
        complete &= absorb(name, r, &mut runs, &mut notes);
    }
    if let Some(pair) = &veth {
        type Across =
            fn(
                &AnatomyConfig,
                &Clock,
                anat::ProbeCost,
                &strait::netns::VethPair,
                &mut dyn FnMut(u64),
            )
                -> Result<(Vec<strait_anatomy::anatomy::AnatomyRun>, Vec<String>), anat::AnatomyError>;
        let paths: [(&str, Across); 2] = [(across::UDP, across::run_udp), (across::XDP, across::run_xdp)];
        for (name, f) in paths {
            if !want(name) {
                continue;
            }
            let mut progress = |size: u64| {
                if std::io::stderr().is_terminal() {
                    eprint!("\rstrait anatomy: {name} {}   ", format_size(size));
                }
            };
            complete &= absorb(name, f(&cfg, &clock, cost, pair, &mut progress), &mut runs, &mut notes);
        }
    }
    let kcfg = kanatomy::KernelConfig {
        sizes: a.sizes.0.iter().copied().filter(|&s| s <= KERNEL_MAX_SIZE).collect(),
        iters: a.iters,
        warmup: a.warmup,
        rounds: a.rounds,
        tolerance: a.tolerance,
        across: match &veth {
            Some(pair) => {
                let ip = |i: usize| {
                    pair.ends[i].ip.parse().map_err(|e| BenchError::Protocol(format!("veth address: {e}")))
                };
                Some(kanatomy::Across {
                    ns: [pair.ends[0].ns.clone(), pair.ends[1].ns.clone()],
                    ip: [ip(0)?, ip(1)?],
                })
            }
            None => None,
        },
    };
    let skipped: Vec<String> =
        a.sizes.0.iter().filter(|&&s| s > KERNEL_MAX_SIZE).map(|&s| format_size(s)).collect();
    for proto in [kanatomy::Proto::Udp, kanatomy::Proto::Tcp] {
        if !want(proto.name()) {
            continue;
        }
        if !skipped.is_empty() {
            notes.push(format!("{}: sizes above 32K not dissected: {}", proto.name(), skipped.join(", ")));
        }
        if kcfg.sizes.is_empty() {
            continue;
        }
        if std::io::stderr().is_terminal() {
            eprint!("\rstrait anatomy: {}            ", proto.name());
        }
        match kanatomy::run(proto, &kcfg, tpn) {
            Ok(r) => runs.extend(r),
            Err(e) => {
                eprintln!("strait anatomy: {}: {e}", proto.name());
                notes.push(format!("{}: not measured: {e}", proto.name()));
                complete = false;
            }
        }
    }
    if std::io::stderr().is_terminal() {
        eprint!("\r{:60}\r", "");
    }
    let mut per: Vec<f64> =
        runs.iter().filter(|r| r.transport == anat::TRANSPORT).map(|r| r.probe_cost_ns).collect();
    let probe_ns = strait_anatomy::stats::median(&mut per).unwrap_or(cost.on_ticks / tpn);
    let report = AnatomyReport {
        machine,
        probe_cost_ns: probe_ns,
        probe_cost_cycles: probe_ns * tpn,
        probe_cost_back_to_back_ns: cost.on_ticks / tpn,
        tolerance: a.tolerance,
        tolerance_floor_ns: strait_anatomy::anatomy::TOLERANCE_FLOOR_NS,
        runs,
        notes,
    };
    let json = report.to_json();
    let dir = result_dir(&a.out, "anatomy", &compact_stamp(started))?;
    let json_path = dir.join("anatomy.json");
    let svg_path = dir.join("anatomy.svg");
    write_file(&json_path, &json)?;
    write_file(&svg_path, &anatomy_svg(&report))?;
    write_file(&dir.join("anatomy-latency.svg"), &render_latency_svg(&report))?;
    print_report(a.format, &json, || anatomy_table(&report), &json_path, &svg_path, &command)?;
    Ok(complete)
}
