//! `strait model`: fit the analytical model (crate `strait-model`) to measurements,
//! check its predictions against measurements at other sizes, and answer what-if
//! questions. docs/MODEL.md is the reference.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{SystemTime, UNIX_EPOCH};

use clap::{Args, Subcommand, ValueEnum};
use strait_anatomy::report::{compact_stamp, rfc3339};
use strait_anatomy::size::{format_size, parse_size_list};
use strait_model::data::{disturbed_rounds, median_points, parse_anatomy, parse_bench, BenchData};
use strait_model::layers::fit_anatomy;
use strait_model::machine::Machine;
use strait_model::paths::COARSE_THRESHOLD;
use strait_model::plot::{render_svg, Series};
use strait_model::validate::{SHM, UDP};
use strait_model::{CheckReport, FittedModel, Metric, ModelError, Point, ShmGeometry};
use thiserror::Error;

/// Why `strait model` failed.
#[derive(Debug, Error)]
pub enum CliError {
    /// The model itself refused (bad input, underdetermined fit).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A measuring run failed.
    #[error("measurement: {0}")]
    Measure(String),
    /// A flag's value is unusable.
    #[error("{0}")]
    Usage(String),
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Human-readable tables.
    Table,
    /// One JSON document on stdout.
    Json,
}

/// `strait model`.
#[derive(Debug, Args)]
pub struct ModelArgs {
    #[command(subcommand)]
    cmd: ModelCmd,
}

#[derive(Debug, Subcommand)]
enum ModelCmd {
    /// Fit per-layer costs (g_i per packet, G_i per byte) to the JSON of `strait anatomy`
    /// (every stage a layer) or `strait bench` (every path end to end; strait's shm
    /// path with its protocol structure), with the fit's residuals.
    Fit(FitArgs),
    /// Fit the model on one set of sizes, predict latency and bandwidth at another,
    /// and compare with what was measured there (runs `strait bench`, or reads its JSON).
    Check(CheckArgs),
    /// Predict latency and bandwidth of a machine described in TOML (what-if: other
    /// thresholds, chunk sizes, a faster copy engine or link), plotted beside measurements.
    Predict(PredictArgs),
}

#[derive(Debug, Args)]
struct FitArgs {
    /// JSON files of `strait anatomy` or `strait bench` (several bench files of one
    /// configuration: the median per size).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Output format on stdout.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Also write the fitted model (bench input) to this file, for `strait model predict`.
    #[arg(long)]
    save: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct CheckArgs {
    /// Output format on stdout.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Paths to check: strait-shm, kernel-udp.
    #[arg(long, value_delimiter = ',', default_value = "strait-shm,kernel-udp")]
    paths: Vec<String>,
    /// Pipelining modes of the shm path: fine (STRAIT_PIPELINE_THRESHOLD as set, default
    /// 64K) and coarse (STRAIT_PIPELINE_THRESHOLD=1024M: one piece as far as the ring allows).
    #[arg(long, value_delimiter = ',', default_value = "fine,coarse")]
    modes: Vec<String>,
    /// Sizes the parameters are fitted on.
    #[arg(long, default_value = "3K,6K,12K,24K,48K,96K,192K,384K,768K,1536K,3M")]
    fit_sizes: String,
    /// Sizes the predictions are checked at (disjoint from the fit sizes).
    #[arg(long, default_value = "4K,8K,16K,32K,64K,128K,256K,512K,1M,2M,4M")]
    check_sizes: String,
    /// Interleaved rounds (each runs every mode once over all sizes); medians per size.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Target duration of one benchmark batch, ms.
    #[arg(long, default_value_t = 10.0)]
    batch_ms: f64,
    /// Read `strait bench --format json` files instead of measuring (each file's
    /// STRAIT_* settings, from its command line, give its shm configuration).
    #[arg(long, num_args = 1..)]
    from: Vec<PathBuf>,
    /// Directory under which model-check-<UTC time>/ is created.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

#[derive(Debug, Args)]
struct PredictArgs {
    /// The machine description (TOML; see docs/MODEL.md).
    machine: PathBuf,
    /// `strait bench --format json` files whose measurements are plotted beside the predictions.
    #[arg(long, num_args = 1..)]
    measured: Vec<PathBuf>,
    /// Output format on stdout.
    #[arg(long, value_enum, default_value = "table")]
    format: Format,
    /// Directory under which model-predict-<UTC time>/ is created.
    #[arg(long, default_value = "results")]
    out: PathBuf,
}

/// Runs `strait model ...`.
pub fn run(args: ModelArgs) -> ExitCode {
    let r = match args.cmd {
        ModelCmd::Fit(a) => fit(a),
        ModelCmd::Check(a) => check(a),
        ModelCmd::Predict(a) => predict(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("strait model: {e}");
            ExitCode::FAILURE
        }
    }
}

fn read(path: &Path) -> Result<String, CliError> {
    std::fs::read_to_string(path).map_err(|e| CliError::File { path: path.display().to_string(), source: e })
}

fn write(path: &Path, text: &str) -> Result<(), CliError> {
    std::fs::write(path, text).map_err(|e| CliError::File { path: path.display().to_string(), source: e })
}

fn sizes(text: &str, what: &str) -> Result<Vec<u64>, CliError> {
    let v = parse_size_list(text).map_err(|e| CliError::Usage(format!("{what}: {e}")))?;
    if v.is_empty() || v.contains(&0) {
        return Err(CliError::Usage(format!("{what}: sizes must be at least 1 byte")));
    }
    Ok(v)
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `out/<kind>-<stamp>`, with a numeric suffix if it exists.
fn result_dir(out: &Path, kind: &str) -> Result<PathBuf, CliError> {
    let io = |p: &Path, e| CliError::File { path: p.display().to_string(), source: e };
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let stamp = compact_stamp(now());
    for n in 0..1000 {
        let dir = out.join(if n == 0 { format!("{kind}-{stamp}") } else { format!("{kind}-{stamp}-{n}") });
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io(&dir, e)),
        }
    }
    Err(CliError::Usage(format!("{}: too many runs in one second", out.display())))
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./,=:+@%".contains(c)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn fmt_ns(ns: f64) -> String {
    if ns.abs() >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns.abs() >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

fn fmt_value(metric: Metric, v: f64) -> String {
    match metric {
        Metric::Latency => fmt_ns(v),
        Metric::Bandwidth => format!("{v:.3} GB/s"),
    }
}

fn geometry_of(d: &BenchData) -> Result<ShmGeometry, ModelError> {
    ShmGeometry::from_env(|k| d.env(k).map(str::to_owned))
}

/// Splits bench documents into shm runs per geometry and other paths' points,
/// each the median over the documents that share a geometry.
/// The shm path's runs, each with its geometry.
type ShmRuns = Vec<(ShmGeometry, Vec<Point>)>;

fn group(docs: &[BenchData]) -> Result<(ShmRuns, Vec<Point>), ModelError> {
    let mut geos: Vec<(ShmGeometry, Vec<Vec<Point>>)> = Vec::new();
    let mut other: Vec<Vec<Point>> = Vec::new();
    for d in docs {
        let shm: Vec<Point> = d.points.iter().filter(|p| p.path == SHM).cloned().collect();
        if !shm.is_empty() {
            let g = geometry_of(d)?;
            match geos.iter_mut().find(|x| x.0 == g) {
                Some(x) => x.1.push(shm),
                None => geos.push((g, vec![shm])),
            }
        }
        other.push(d.points.iter().filter(|p| p.path != SHM).cloned().collect());
    }
    let shm = geos.into_iter().map(|(g, r)| (g, median_points(&r))).collect();
    Ok((shm, median_points(&other)))
}

// ---------------------------------------------------------------- fit

fn fit(a: FitArgs) -> Result<(), CliError> {
    let mut anatomy = Vec::new();
    let mut bench = Vec::new();
    for f in &a.files {
        let text = read(f)?;
        let what = |e: ModelError| CliError::Usage(format!("{}: {e}", f.display()));
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| CliError::Usage(format!("{}: not JSON: {e}", f.display())))?;
        if v.get("runs").is_some() {
            anatomy.extend(parse_anatomy(&text).map_err(what)?);
        } else if v.get("results").is_some() {
            bench.push(parse_bench(&text).map_err(what)?);
        } else {
            return Err(CliError::Usage(format!(
                "{}: neither a `strait anatomy` (runs) nor a `strait bench` (results) document",
                f.display()
            )));
        }
    }
    let layers = if anatomy.is_empty() { Vec::new() } else { fit_anatomy(&anatomy)? };
    let model = if bench.is_empty() {
        None
    } else {
        let (shm, other) = group(&bench)?;
        Some(FittedModel::fit(&shm, &other, |_| true)?)
    };
    if let (Some(path), Some(m)) = (&a.save, &model) {
        write(path, &serde_json::to_string_pretty(m).map_err(|e| CliError::Usage(e.to_string()))?)?;
    } else if a.save.is_some() {
        return Err(CliError::Usage("--save needs a `strait bench` document to fit".into()));
    }
    match a.format {
        Format::Json => {
            let doc = serde_json::json!({ "layers": layers, "model": model });
            println!("{doc}");
        }
        Format::Table => {
            let mut s = String::new();
            for r in &layers {
                let _ = writeln!(
                    s,
                    "{} ({}), layers fitted over {} (g_i per packet, G_i per byte):",
                    r.path,
                    r.regime,
                    r.sizes.iter().map(|&b| format_size(b)).collect::<Vec<_>>().join(",")
                );
                let _ =
                    writeln!(s, "  {:<40} {:>12} {:>14} {:>10}", "layer", "g_i", "G_i (ns/KiB)", "rms resid");
                for l in &r.layers {
                    let _ = writeln!(
                        s,
                        "  {:<40} {:>12} {:>14.2} {:>9.1}%",
                        l.name,
                        fmt_ns(l.fit.per_packet_ns),
                        l.fit.per_byte_ns * 1024.0,
                        l.fit.rms_rel * 100.0
                    );
                }
                let _ = writeln!(
                    s,
                    "  sum of the fitted layers (eq. 1) vs measured one-way: rms {:.1}%\n",
                    r.sum_rms_rel * 100.0
                );
            }
            if let Some(m) = &model {
                s.push_str(&describe_model(m));
            }
            print!("{s}");
        }
    }
    Ok(())
}

fn describe_model(m: &FittedModel) -> String {
    let mut s = String::new();
    if let Some(shm) = &m.shm {
        let _ = writeln!(s, "strait-shm:");
        // The runs' rendezvous path, and what `auto` takes on this host.
        let _ = writeln!(
            s,
            "  rendezvous measured and modelled: {} ({}); this host's {}",
            std::env::var("STRAIT_RNDV_MODE").unwrap_or_else(|_| "copy".into()),
            if std::env::var_os("STRAIT_RNDV_MODE").is_some() {
                "STRAIT_RNDV_MODE"
            } else {
                "pinned by strait model"
            },
            strait_shm::calibrate::calibration().describe()
        );
        let e = &shm.eager;
        let _ = writeln!(
            s,
            "  eager latency: g = {}, G = {:.2} ns/KiB (rms residual {:.1}%)",
            fmt_ns(e.per_packet_ns),
            e.per_byte_ns * 1024.0,
            e.rms_rel * 100.0
        );
        if let Some(r) = &shm.rndv {
            let _ = writeln!(
                s,
                "  rendezvous latency: handshake {}, per piece {}, copies {:.2} ns/KiB together, copy-in share {:.2} (rms residual {:.1}%)",
                fmt_ns(r.fixed_ns),
                fmt_ns(r.per_piece_ns),
                r.per_byte_ns * 1024.0,
                r.copy_in_share,
                r.rms_rel * 100.0
            );
        }
        for (g, b) in &shm.bandwidth {
            for (name, l) in [("eager", &b.eager), ("rendezvous", &b.rndv)] {
                if let Some(l) = l {
                    let _ = writeln!(
                        s,
                        "  bandwidth, {} {name}: bottleneck g_b = {}, G_b = {:.2} ns/KiB, at most {:.1} GB/s (rms residual {:.1}%)",
                        g.pipelining(),
                        fmt_ns(l.per_packet_ns),
                        l.per_byte_ns * 1024.0,
                        1.0 / l.per_byte_ns.max(1e-12),
                        l.rms_rel * 100.0
                    );
                }
            }
        }
        if let Some(r) = &shm.rndv {
            let _ = writeln!(
                s,
                "  eq. 2/4 from the latency layers alone: the slower copy ({:.2} ns/KiB) allows at most {:.1} GB/s",
                r.bottleneck_per_byte_ns() * 1024.0,
                1.0 / r.bottleneck_per_byte_ns().max(1e-12)
            );
        }
    }
    if let Some(u) = &m.udp {
        let _ = writeln!(s, "kernel-udp:");
        if let Some(l) = &u.latency {
            let _ = writeln!(
                s,
                "  latency (one datagram): g = {}, G = {:.2} ns/KiB (rms residual {:.1}%)",
                fmt_ns(l.per_packet_ns),
                l.per_byte_ns * 1024.0,
                l.rms_rel * 100.0
            );
        }
        let _ = writeln!(
            s,
            "  streaming: per message {}, per datagram {}, G = {:.2} ns/KiB (rms residual {:.1}%)",
            fmt_ns(u.per_message_ns),
            fmt_ns(u.per_datagram_ns),
            u.per_byte_ns * 1024.0,
            u.bandwidth_rms_rel * 100.0
        );
    }
    for (n, l) in &m.lumped {
        let _ = writeln!(s, "{n} (end to end):");
        for (what, f) in [("latency", &l.latency), ("streaming time per message", &l.bandwidth)] {
            if let Some(f) = f {
                let _ = writeln!(
                    s,
                    "  {what}: g = {}, G = {:.2} ns/KiB (rms residual {:.1}%)",
                    fmt_ns(f.per_packet_ns),
                    f.per_byte_ns * 1024.0,
                    f.rms_rel * 100.0
                );
            }
        }
    }
    s
}

// ---------------------------------------------------------------- check

/// Share of a run's CPU time above which other processes (or the hypervisor, as
/// steal time) are taken to have disturbed it.
const OTHERS_DISTURBED: f64 = 0.10;

/// CPU ticks of the whole machine (not idle, all) and of this process's waited-for
/// children, from /proc (USER_HZ ticks; only ratios are used).
fn cpu_ticks() -> Option<(u64, u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let v: Vec<u64> =
        stat.lines().next()?.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    if v.len() < 8 {
        return None;
    }
    let total: u64 = v[..8].iter().sum();
    // Interrupt and softirq time is left out: the kernel paths' own packet processing
    // lands there, not in the bench processes' CPU time.
    let busy = v[0] + v[1] + v[2] + v[7];
    let me = std::fs::read_to_string("/proc/self/stat").ok()?;
    let f: Vec<&str> = me.rsplit_once(')')?.1.split_whitespace().collect();
    // After the command name come fields 3 (state), 4, ...: cutime and cstime, the CPU
    // time of waited-for children, are fields 16 and 17.
    let num = |k: usize| f.get(k - 3).and_then(|x| x.parse::<u64>().ok());
    let kids = num(16)? + num(17)?;
    Some((busy, total, kids))
}

/// The share of the machine's CPU time during a run used by anything but the run
/// (other processes, interrupts, steal), if /proc tells.
fn others_share(before: Option<(u64, u64, u64)>, after: Option<(u64, u64, u64)>) -> Option<f64> {
    let ((b0, t0, k0), (b1, t1, k1)) = (before?, after?);
    let total = t1.checked_sub(t0)?;
    if total == 0 {
        return None;
    }
    let others = (b1.saturating_sub(b0)).saturating_sub(k1.saturating_sub(k0));
    Some(others as f64 / total as f64)
}

/// Longest total time `strait model check` waits for the machine to be idle before
/// its runs.
const QUIET_BUDGET: std::time::Duration = std::time::Duration::from_secs(20);

/// Waits (sampling /proc/stat every 250 ms) until less than `OTHERS_DISTURBED` of the
/// CPU time is busy, spending at most what is left of `budget`; returns whether the
/// machine was quiet.
fn wait_quiet(budget: &mut std::time::Duration) -> bool {
    let step = std::time::Duration::from_millis(250);
    loop {
        let a = cpu_ticks();
        std::thread::sleep(step);
        let b = cpu_ticks();
        let busy = match (a, b) {
            (Some((b0, t0, _)), Some((b1, t1, _))) if t1 > t0 => (b1 - b0) as f64 / (t1 - t0) as f64,
            _ => return true, // no /proc/stat: do not wait
        };
        *budget = budget.saturating_sub(step);
        if busy < OTHERS_DISTURBED {
            return true;
        }
        if budget.is_zero() {
            return false;
        }
    }
}

/// Drops the runs marked `bad`, remembering their share of other work.
/// Measuring runs: (coarse pipelining?, the bench document, share of the CPU time
/// other work took, the bench's result directory).
type Runs = Vec<(bool, BenchData, Option<f64>, Option<PathBuf>)>;

/// Drops the runs marked `bad`, remembering their share of other work, and moves
/// their result directories into `disturbed/` beside them (so that `--from
/// bench-runs/*/bench.json` re-reads exactly the runs that were used).
fn drop_runs(runs: &mut Runs, bad: &[bool], seen: &mut Vec<f64>) {
    let mut i = 0;
    runs.retain(|r| {
        i += 1;
        if bad[i - 1] {
            seen.extend(r.2);
            if let Some((dir, parent, name)) =
                r.3.as_ref().and_then(|d| Some((d, d.parent()?, d.file_name()?)))
            {
                let to = parent.join("disturbed");
                let _ = std::fs::create_dir_all(&to).and_then(|()| std::fs::rename(dir, to.join(name)));
            }
        }
        !bad[i - 1]
    });
}

/// One `strait bench` run of this executable: its JSON parsed, and the share of the
/// CPU time other work took meanwhile.
fn bench_once(
    transports: &[&str],
    sizes: &str,
    batch_ms: f64,
    coarse: bool,
    out: &Path,
) -> Result<(BenchData, Option<f64>, Option<PathBuf>), CliError> {
    // /proc/self/exe runs this very image even if the file was replaced meanwhile (a
    // rebuild of target/release/strait during a check).
    let exe = match Path::new("/proc/self/exe") {
        p if p.exists() => p.to_path_buf(),
        _ => std::env::current_exe().map_err(|e| CliError::Measure(format!("own executable: {e}")))?,
    };
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "--format", "json", "--no-progress", "--count-iters", "0", "--rounds", "1"])
        .args(["--batch-ms", &batch_ms.to_string(), "--warmup", "200"])
        .args(["--lat-sizes", sizes, "--bw-sizes", sizes, "--transports", &transports.join(",")])
        .arg("--out")
        .arg(out);
    if coarse {
        cmd.env("STRAIT_PIPELINE_THRESHOLD", format!("{}M", COARSE_THRESHOLD >> 20));
    }
    // The model's rendezvous equations describe the pipelined copy through the ring:
    // measure that path, whatever the host's calibration would pick for `auto`.
    if std::env::var_os("STRAIT_RNDV_MODE").is_none() {
        cmd.env("STRAIT_RNDV_MODE", "copy");
    }
    let before = cpu_ticks();
    let o = cmd.output().map_err(|e| CliError::Measure(format!("strait bench: {e}")))?;
    let others = others_share(before, cpu_ticks());
    if !o.status.success() {
        return Err(CliError::Measure(format!(
            "strait bench failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let d = parse_bench(&text).map_err(|e| CliError::Measure(format!("strait bench output: {e}")))?;
    // "wrote DIR/bench.json and DIR/bench.svg" on stderr names the run's directory.
    let dir = String::from_utf8_lossy(&o.stderr).lines().find_map(|l| {
        let json = l.strip_prefix("wrote ")?.split(" and ").next()?;
        Path::new(json).parent().map(Path::to_path_buf)
    });
    Ok((d, others, dir))
}

fn check_command(a: &CheckArgs) -> String {
    let mut env: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("STRAIT_"))
        .map(|(k, v)| format!("{k}={}", shell_quote(&v)))
        .collect();
    env.sort();
    let exe = std::env::args().next().unwrap_or_else(|| "strait".into());
    let mut p = env;
    p.push(shell_quote(&exe));
    p.push("model check".into());
    p.push(format!("--format {}", if a.format == Format::Json { "json" } else { "table" }));
    p.push(format!("--paths {}", a.paths.join(",")));
    p.push(format!("--modes {}", a.modes.join(",")));
    p.push(format!("--fit-sizes {} --check-sizes {}", a.fit_sizes, a.check_sizes));
    if a.from.is_empty() {
        p.push(format!("--rounds {} --batch-ms {}", a.rounds, a.batch_ms));
    } else {
        p.push("--from".into());
        p.extend(a.from.iter().map(|f| shell_quote(&f.to_string_lossy())));
    }
    p.push(format!("--out {}", shell_quote(&a.out.to_string_lossy())));
    p.join(" ")
}

fn check(a: CheckArgs) -> Result<(), CliError> {
    let fit_sizes = sizes(&a.fit_sizes, "--fit-sizes")?;
    let check_sizes = sizes(&a.check_sizes, "--check-sizes")?;
    if !(a.batch_ms > 0.0 && a.batch_ms.is_finite()) {
        return Err(CliError::Usage("--batch-ms must be a positive number".into()));
    }
    for p in &a.paths {
        if p != SHM && p != UDP {
            return Err(CliError::Usage(format!("--paths: unknown path {p:?} (known: {SHM}, {UDP})")));
        }
    }
    let mut modes = Vec::new();
    for m in &a.modes {
        match m.as_str() {
            "fine" => modes.push(false),
            "coarse" => modes.push(true),
            other => return Err(CliError::Usage(format!("--modes: {other:?} is neither fine nor coarse"))),
        }
    }
    if modes.is_empty() {
        return Err(CliError::Usage("--modes: at least one of fine, coarse".into()));
    }
    let command = check_command(&a);
    let started = now();
    let dir = result_dir(&a.out, "model-check")?;
    let mut notes = Vec::new();
    let mut disturbed = 0;
    let docs: Vec<BenchData> = if a.from.is_empty() {
        let mut all: Vec<u64> = fit_sizes.iter().chain(&check_sizes).copied().collect();
        all.sort_unstable();
        all.dedup();
        let list = all.iter().map(|&b| format_size(b)).collect::<Vec<_>>().join(",");
        let want_shm = a.paths.iter().any(|p| p == SHM);
        let want_udp = a.paths.iter().any(|p| p == UDP);
        let raw = dir.join("bench-runs");
        let mut runs: Runs = Vec::new();
        let mut quiet_budget = QUIET_BUDGET;
        let mut busy_start = 0;
        let mut measure_round = |label: &str, runs: &mut Runs| -> Result<(), CliError> {
            for &coarse in &modes {
                // kernel-udp does not depend on strait's settings: it runs with the first mode.
                let mut t: Vec<&str> = Vec::new();
                if want_shm {
                    t.push(SHM);
                }
                if want_udp && coarse == modes[0] {
                    t.push(UDP);
                }
                if t.is_empty() {
                    continue;
                }
                if std::io::stderr().is_terminal() {
                    eprint!("\rstrait model check: {label} {}   ", if coarse { "coarse" } else { "fine" });
                }
                if !quiet_budget.is_zero() && !wait_quiet(&mut quiet_budget) {
                    busy_start += 1;
                }
                let (d, others, run_dir) = bench_once(&t, &list, a.batch_ms, coarse, &raw)?;
                runs.push((coarse, d, others, run_dir));
            }
            Ok(())
        };
        for round in 0..a.rounds {
            measure_round(&format!("round {}/{}", round + 1, a.rounds), &mut runs)?;
        }
        // A run during which other work took more than OTHERS_DISTURBED of the CPU
        // time, or clearly slower than the best runs of its mode (the host moved a
        // vCPU, or both processes shared one), was disturbed. Extra rounds are
        // measured (at most twice --rounds) until each mode has at least half its
        // rounds (and two) undisturbed; then the disturbed runs are dropped.
        let min_good = (a.rounds as usize).div_ceil(2).max(2);
        let mut extra = 0;
        let mut others_seen: Vec<f64> = Vec::new();
        loop {
            let mut bad: Vec<bool> = runs.iter().map(|r| r.2.is_some_and(|x| x > OTHERS_DISTURBED)).collect();
            for &coarse in &modes {
                let idx: Vec<usize> = (0..runs.len()).filter(|&i| runs[i].0 == coarse).collect();
                let pts: Vec<Vec<Point>> = idx.iter().map(|&i| runs[i].1.points.clone()).collect();
                for (k, d) in disturbed_rounds(&pts).into_iter().enumerate() {
                    bad[idx[k]] |= d;
                }
            }
            let n = bad.iter().filter(|b| **b).count();
            if n == 0 {
                break;
            }
            let good_in = |c: bool| runs.iter().zip(&bad).filter(|(r, b)| r.0 == c && !**b).count();
            let enough = modes.iter().all(|&c| good_in(c) >= min_good);
            if enough || extra >= 2 * a.rounds {
                disturbed += n;
                if modes.iter().all(|&c| good_in(c) >= 2) {
                    drop_runs(&mut runs, &bad, &mut others_seen);
                    notes.push(format!("{n} disturbed runs dropped ({extra} extra rounds measured)"));
                } else {
                    notes.push(format!(
                        "{n} runs look disturbed but are kept: fewer than two rounds of a mode were undisturbed in {} (a busy machine)",
                        a.rounds + extra
                    ));
                }
                break;
            }
            extra += 1;
            measure_round(&format!("extra round {extra}"), &mut runs)?;
        }
        others_seen.extend(runs.iter().filter_map(|r| r.2));
        if std::io::stderr().is_terminal() {
            eprint!("\r{:60}\r", "");
        }
        if busy_start > 0 {
            notes.push(format!(
                "{busy_start} runs started on a busy machine (waited up to {} s in all for it to be idle)",
                QUIET_BUDGET.as_secs()
            ));
        }
        if let Some(max) = others_seen.iter().copied().reduce(f64::max) {
            notes.push(format!(
                "CPU time taken by other work during the runs: up to {:.0}% (runs above {:.0}% count as disturbed)",
                max * 100.0,
                OTHERS_DISTURBED * 100.0
            ));
        }
        notes.push(format!(
            "measured {} with `strait bench` ({} interleaved rounds, {} runs found disturbed; medians per size; raw runs in {})",
            rfc3339(started),
            a.rounds,
            disturbed,
            raw.display()
        ));
        runs.into_iter().map(|r| r.1).collect()
    } else {
        a.from
            .iter()
            .map(|f| read(f).and_then(|t| parse_bench(&t).map_err(CliError::from)))
            .collect::<Result<_, _>>()?
    };
    let (mut shm, mut other) = group(&docs)?;
    if !a.paths.iter().any(|p| p == SHM) {
        shm.clear();
    }
    other.retain(|p| a.paths.contains(&p.path));
    let mut report = CheckReport::run(&shm, &other, &fit_sizes, &check_sizes, command.clone())?;
    report.notes = notes;
    report.disturbed_runs = disturbed;
    let json = serde_json::to_string(&report).map_err(|e| CliError::Usage(e.to_string()))?;
    let json_path = dir.join("check.json");
    let svg_path = dir.join("check.svg");
    write(&json_path, &json)?;
    write(
        &dir.join("model.json"),
        &serde_json::to_string_pretty(&report.model).map_err(|e| CliError::Usage(e.to_string()))?,
    )?;
    write(&svg_path, &check_svg(&report, &shm, &other, &fit_sizes, &check_sizes))?;
    match a.format {
        Format::Json => {
            println!("{json}");
            eprintln!("wrote {} and {}", json_path.display(), svg_path.display());
            eprintln!("reproduce with: {command}");
        }
        Format::Table => {
            print!("{}", check_table(&report));
            println!("\nwrote {}, {} and model.json", json_path.display(), svg_path.display());
            println!("reproduce with: {command}");
        }
    }
    Ok(())
}

fn check_table(r: &CheckReport) -> String {
    let mut s = String::new();
    let join = |v: &[u64]| v.iter().map(|&b| format_size(b)).collect::<Vec<_>>().join(",");
    let _ = writeln!(
        s,
        "strait model check: fitted on {}, checked at {}\n",
        join(&r.fit_sizes),
        join(&r.check_sizes)
    );
    s.push_str(&describe_model(&r.model));
    let _ = writeln!(
        s,
        "\n{:<12} {:<7} {:<10} {:>6} {:>14} {:>14} {:>8}",
        "path", "mode", "metric", "size", "predicted", "measured", "error"
    );
    for c in &r.cases {
        let _ = writeln!(
            s,
            "{:<12} {:<7} {:<10} {:>6} {:>14} {:>14} {:>7.1}%",
            c.path,
            c.pipelining.as_deref().unwrap_or("-"),
            c.metric.name(),
            format_size(c.size_bytes),
            fmt_value(c.metric, c.predicted),
            fmt_value(c.metric, c.measured),
            c.rel_error * 100.0
        );
    }
    let _ = writeln!(s);
    for m in &r.medians {
        let _ = writeln!(
            s,
            "median error {:<12} {:<10} {:>6.1}%  (max {:.1}%, {} cases)",
            m.path,
            m.metric.name(),
            m.median_rel_error * 100.0,
            m.max_rel_error * 100.0,
            m.cases
        );
    }
    let _ = writeln!(s, "median error, all cases: {:.1}%", r.median_rel_error * 100.0);
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

/// Sizes for drawing a model's curve: the measured range, 8 points per octave.
fn curve_sizes(lo: u64, hi: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut x = lo.max(1) as f64;
    while x <= hi as f64 * 1.0001 {
        v.push(x.round() as u64);
        x *= 2f64.powf(1.0 / 8.0);
    }
    v.dedup();
    v
}

fn check_svg(
    r: &CheckReport,
    shm: &[(ShmGeometry, Vec<Point>)],
    other: &[Point],
    fit_sizes: &[u64],
    check_sizes: &[u64],
) -> String {
    let all: Vec<u64> = fit_sizes.iter().chain(check_sizes).copied().collect();
    let (lo, hi) = (all.iter().copied().min().unwrap_or(1024), all.iter().copied().max().unwrap_or(1 << 22));
    let grid = curve_sizes(lo, hi);
    let mut series = Vec::new();
    let mut colour = 0;
    let mut add = |label: String, geo: Option<&ShmGeometry>, path: &str, pts: Vec<&Point>| {
        for metric in [Metric::Latency, Metric::Bandwidth] {
            let curve: Vec<(u64, f64)> =
                grid.iter().filter_map(|&b| r.model.predict(path, geo, metric, b).map(|v| (b, v))).collect();
            series.push(Series {
                label: format!("{label} model"),
                metric,
                points: curve,
                measured: false,
                colour,
            });
            let m: Vec<(u64, f64)> =
                pts.iter().filter(|p| p.metric == metric).map(|p| (p.size_bytes, p.value)).collect();
            series.push(Series {
                label: format!("{label} measured"),
                metric,
                points: m,
                measured: true,
                colour,
            });
        }
        colour += 1;
    };
    for (g, pts) in shm {
        add(format!("{SHM} {}", g.pipelining()), Some(g), SHM, pts.iter().collect());
    }
    let mut names: Vec<&str> = other.iter().map(|p| p.path.as_str()).collect();
    names.dedup();
    for n in names {
        add(n.to_owned(), None, n, other.iter().filter(|p| p.path == n).collect());
    }
    let title = format!(
        "strait model check: fitted at {} sizes, checked at {}; median error {:.1}%",
        fit_sizes.len(),
        check_sizes.len(),
        r.median_rel_error * 100.0
    );
    render_svg(&title, &series)
}

// ---------------------------------------------------------------- predict

fn predict(a: PredictArgs) -> Result<(), CliError> {
    let text = read(&a.machine)?;
    let machine =
        Machine::parse(&text).map_err(|e| CliError::Usage(format!("{}: {e}", a.machine.display())))?;
    let sizes = machine.sizes()?;
    let base = match &machine.model {
        Some(m) => {
            let p = a.machine.parent().unwrap_or(Path::new(".")).join(m);
            let t = read(&p)?;
            let fm: FittedModel = serde_json::from_str(&t)
                .map_err(|e| CliError::Usage(format!("{}: not a fitted model: {e}", p.display())))?;
            Some(fm)
        }
        None => None,
    };
    // Scenarios: (label, closure giving (latency, bandwidth) at a size).
    type Predictor<'a> = Box<dyn Fn(u64) -> (Option<f64>, Option<f64>) + 'a>;
    let mut scenarios: Vec<(String, Predictor)> = Vec::new();
    if let (Some(spec), Some(fm)) = (&machine.shm, &base) {
        let shm =
            fm.shm.clone().ok_or_else(|| CliError::Usage("the model file has no strait-shm fit".into()))?;
        let g0 = *fm
            .shm_geometries
            .first()
            .ok_or_else(|| CliError::Usage("the model file has no shm geometry".into()))?;
        let g1 = spec.geometry(&g0)?;
        let scaled = spec.scaled(&shm)?;
        let base_shm = shm.clone();
        scenarios.push((
            format!("{SHM} fitted ({})", g0.pipelining()),
            Box::new(move |b| (base_shm.latency(&g0, b), base_shm.bandwidth(&g0, b))),
        ));
        scenarios.push((
            format!("{SHM} what-if ({}, chunk {})", g1.pipelining(), format_size(g1.chunk_size)),
            Box::new(move |b| (scaled.latency(&g1, b), scaled.bandwidth(&g1, b))),
        ));
    }
    for p in &machine.path {
        let p = p.clone();
        scenarios.push((
            p.name.clone(),
            Box::new(move |b| p.predict(b).map_or((None, None), |(l, w)| (Some(l), Some(w)))),
        ));
    }
    let mut measured: Vec<BenchData> = Vec::new();
    for f in &a.measured {
        measured.push(parse_bench(&read(f)?).map_err(|e| CliError::Usage(format!("{}: {e}", f.display())))?);
    }
    let mut rows = Vec::new();
    for (label, f) in &scenarios {
        for &b in &sizes {
            let (l, w) = f(b);
            rows.push(
                serde_json::json!({"scenario": label, "size_bytes": b, "latency_ns": l, "gbytes_per_s": w}),
            );
        }
    }
    let dir = result_dir(&a.out, "model-predict")?;
    let mut series = Vec::new();
    let grid = curve_sizes(*sizes.iter().min().unwrap_or(&1024), *sizes.iter().max().unwrap_or(&(1 << 22)));
    for (i, (label, f)) in scenarios.iter().enumerate() {
        let pts: Vec<(u64, Option<f64>, Option<f64>)> = grid.iter().map(|&b| (b, f(b).0, f(b).1)).collect();
        for (metric, pick) in [(Metric::Latency, 0), (Metric::Bandwidth, 1)] {
            let points =
                pts.iter().filter_map(|&(b, l, w)| if pick == 0 { l } else { w }.map(|v| (b, v))).collect();
            series.push(Series { label: label.clone(), metric, points, measured: false, colour: i });
        }
    }
    // Measured series: per path, and for the shm path per pipelining mode of the run.
    let label_of = |d: &BenchData, path: &str| -> String {
        match (path == SHM, geometry_of(d)) {
            (true, Ok(g)) => format!("{path} {} measured", g.pipelining()),
            _ => format!("{path} measured"),
        }
    };
    let mut labels: Vec<String> =
        measured.iter().flat_map(|d| d.points.iter().map(|p| label_of(d, &p.path))).collect();
    labels.sort();
    labels.dedup();
    for (j, label) in labels.iter().enumerate() {
        for metric in [Metric::Latency, Metric::Bandwidth] {
            let pts: Vec<(u64, f64)> = measured
                .iter()
                .flat_map(|d| {
                    d.points.iter().filter(move |p| p.metric == metric && label_of(d, &p.path) == *label)
                })
                .map(|p| (p.size_bytes, p.value))
                .collect();
            series.push(Series {
                label: label.clone(),
                metric,
                points: pts,
                measured: true,
                colour: scenarios.len() + j,
            });
        }
    }
    let svg_path = dir.join("predict.svg");
    let json_path = dir.join("predict.json");
    let doc = serde_json::json!({"machine": a.machine.display().to_string(), "predictions": rows});
    write(&json_path, &doc.to_string())?;
    write(&svg_path, &render_svg(&format!("strait model predict: {}", a.machine.display()), &series))?;
    match a.format {
        Format::Json => {
            println!("{doc}");
            eprintln!("wrote {} and {}", json_path.display(), svg_path.display());
        }
        Format::Table => {
            let mut s = String::new();
            let _ = writeln!(s, "{:<44} {:>6} {:>14} {:>12}", "scenario", "size", "latency", "bandwidth");
            for (label, f) in &scenarios {
                for &b in &sizes {
                    let (l, w) = f(b);
                    let _ = writeln!(
                        s,
                        "{:<44} {:>6} {:>14} {:>12}",
                        label,
                        format_size(b),
                        l.map_or("-".into(), fmt_ns),
                        w.map_or("-".into(), |w| format!("{w:.3} GB/s"))
                    );
                }
            }
            print!("{s}");
            println!("\nwrote {} and {}", json_path.display(), svg_path.display());
        }
    }
    Ok(())
}
