//! The `strait anatomy` report: its JSON schema, the tables and the SVG chart.
//!
//! ```json
//! {"machine": {...}, "probe_cost_ns": 9.1, "probe_cost_cycles": 24.0,
//!  "tolerance": 0.1, "notes": ["..."],
//!  "runs": [{"transport": "strait-shm", "size_bytes": 8,
//!            "measured_one_way_ns": 190.0, "stage_sum_ns": 184.2,
//!            "total_p50_ns": 180.1, "probed_one_way_ns": 260.3,
//!            "probe_overhead_ns": 76.1, "deviation": -0.03, "within_tolerance": true,
//!            "samples": 400,
//!            "stages": [{"name": "...", "layer": "copy", "ns": 12.0,
//!                        "p50_ns": 11.5, "p99_ns": 30.2, "cycles": 31.0,
//!                        "on_critical_path": true}]}]}
//! ```

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::report::{fmt_ns, MachineInfo};
use crate::size::format_size;

/// One stage of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageRow {
    /// Stage name.
    pub name: String,
    /// Category: `user`, `protocol send`, `protocol receive`, `OS overhead`,
    /// `copy`, `device/wire`.
    pub layer: String,
    /// Mean time of the stage over the kept iterations (the fastest half), probe
    /// cost subtracted, ns. The `ns` of the critical-path stages add up to
    /// `stage_sum_ns`.
    pub ns: f64,
    /// Median, ns.
    pub p50_ns: f64,
    /// 99th percentile, ns.
    pub p99_ns: f64,
    /// `ns` in counter cycles (TSC ticks).
    pub cycles: f64,
    /// False for stages that overlap the path (reported, not summed).
    pub on_critical_path: bool,
    /// Mean time of the stage over the kept iterations before the per-event
    /// tracing cost is subtracted, ns (the kernel paths; `None` where the stages are
    /// computed with the cost inside them). A stage with a positive `raw_ns` was
    /// observed even where `ns` reads 0: it is shorter than the calibration's error.
    #[serde(default)]
    pub raw_ns: Option<f64>,
}

/// One transport at one message size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnatomyRun {
    /// Transport name, as in `strait bench`.
    pub transport: String,
    /// Message size.
    pub size_bytes: u64,
    /// One-way latency measured with the probes switched off, in batches
    /// interleaved with the probed ones: half the round trip, mean of the fastest
    /// half of the iterations, ns.
    pub measured_one_way_ns: f64,
    /// Sum of the critical-path stages (probe cost subtracted), ns.
    pub stage_sum_ns: f64,
    /// Median one-way time of the probed iterations, probe cost subtracted, ns.
    pub total_p50_ns: f64,
    /// Mean one-way time of the probed iterations as measured, probes included, ns.
    pub probed_one_way_ns: f64,
    /// Probe cost subtracted per one-way path, ns.
    pub probe_overhead_ns: f64,
    /// Cost of one probe on this path, ns (what is subtracted per probe): the
    /// one-way time of the probed batches minus that of the unprobed ones, per probe
    /// on the path. Calibrated on the same run, so the sum check verifies that the
    /// stages cover the path without gap or overlap, not the cost itself.
    pub probe_cost_ns: f64,
    /// Independent estimate of the same, ns: the growth of the one-way time when
    /// every probe stamps twice, per probe (a back-to-back second stamp: an upper
    /// estimate, since a single probe overlaps the work around it).
    /// Null for the kernel paths (no doubled tracepoints).
    pub probe_cost_doubled_ns: Option<f64>,
    /// `deviation` had `probe_cost_doubled_ns` been subtracted instead.
    pub deviation_doubled: Option<f64>,
    /// `(stage_sum_ns - measured_one_way_ns) / measured_one_way_ns`.
    pub deviation: f64,
    /// The stage sum agrees with the measured latency: `|deviation| <= tolerance`,
    /// or the two differ by at most `tolerance_floor_ns` ([`agrees`]).
    pub within_tolerance: bool,
    /// One-way paths analysed.
    pub samples: usize,
    /// The stages in path order.
    pub stages: Vec<StageRow>,
    /// The kernel paths' wake-up modes (absent elsewhere, and in documents written
    /// before they were reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_modes: Option<WakeModes>,
}

/// How often the receiver of a kernel path was asleep when the data arrived. The
/// kernel path is bimodal: a sleeping receiver adds a `sched_wakeup`, an IPI and a
/// switch-in (tens of µs on a VM), a running one none. Traced and untraced batches
/// can catch the two in different proportions, so the check compares like with like
/// when the modes are separable (`mode_aware`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WakeModes {
    /// Share of the traced one-way paths whose receiver was woken.
    pub woken_traced: f64,
    /// Estimated share in the untraced batches (their round trips classified by
    /// time, see `modes`); `None` when the modes could not be told apart by time.
    pub woken_plain: Option<f64>,
    /// The stage sum and the measured time were compared mode by mode (reweighted
    /// to the untraced batches' mix); false: as for a unimodal path.
    pub mode_aware: bool,
    /// The modes compared, by wake-ups per round trip (empty unless `mode_aware`).
    pub modes: Vec<WakeMode>,
}

/// One wake-up mode of a kernel path: round trips with the same number of
/// wake-ups (0, 1 or 2: one per direction).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WakeMode {
    /// Receivers woken per round trip.
    pub wakeups_per_round_trip: u32,
    /// Share of the traced round trips.
    pub traced_share: f64,
    /// Share of the untraced round trips (classified by their time).
    pub plain_share: f64,
    /// This mode's stage sum, one way, tracing cost subtracted, ns.
    pub stage_sum_ns: f64,
    /// This mode's untraced one-way time, ns (`NaN` if none was seen).
    pub measured_one_way_ns: f64,
    /// The per-event tracing cost calibrated on this mode, ns.
    pub probe_cost_ns: f64,
}

/// Below this absolute difference (ns) a stage sum agrees with the measured
/// one-way time whatever the relative deviation. strait's eager path carries nine
/// probes of ~4 ns each, ~35 ns subtracted from a path that takes ~90 ns at 8 B on
/// a fast day; the calibration of that cost is uncertain by a nanosecond or more
/// per probe (the doubled-probe estimate gives twice the in-situ one), more than
/// 10% of such a path (the check missed by 11-14 ns that way).
pub const TOLERANCE_FLOOR_NS: f64 = 15.0;

/// Whether a stage sum agrees with the measured one-way time: within `tolerance`
/// relative to it, or within [`TOLERANCE_FLOOR_NS`].
pub fn agrees(stage_sum_ns: f64, measured_ns: f64, tolerance: f64) -> bool {
    let diff = stage_sum_ns - measured_ns;
    (diff / measured_ns).abs() <= tolerance || diff.abs() <= TOLERANCE_FLOOR_NS
}

/// A whole `strait anatomy` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnatomyReport {
    /// The machine and the command.
    pub machine: MachineInfo,
    /// Cost of one probe on the path (median over the runs of their
    /// `probe_cost_ns`; what is subtracted), ns.
    pub probe_cost_ns: f64,
    /// The same in counter cycles.
    pub probe_cost_cycles: f64,
    /// Cost of one probe in a loop of back-to-back probes, ns (a microbenchmark:
    /// on the path, probes overlap other work and cost less).
    pub probe_cost_back_to_back_ns: f64,
    /// Largest accepted |deviation| of the stage sum from the measured latency.
    pub tolerance: f64,
    /// Largest accepted absolute difference, ns, whatever the deviation
    /// ([`TOLERANCE_FLOOR_NS`]).
    #[serde(default)]
    pub tolerance_floor_ns: f64,
    /// One entry per transport and size.
    pub runs: Vec<AnatomyRun>,
    /// What could not be measured, and why.
    pub notes: Vec<String>,
}

impl AnatomyReport {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// Parses a document written by [`AnatomyReport::to_json`].
    pub fn from_json(text: &str) -> Result<AnatomyReport, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Transports in first-seen order.
    pub fn transports(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for r in &self.runs {
            if !v.contains(&r.transport) {
                v.push(r.transport.clone());
            }
        }
        v
    }
}

fn pad(s: &str, w: usize) -> String {
    format!("{s:>w$}")
}

/// The layer-by-size table of each transport (rows: stages; columns: sizes), the
/// check of stage sums against the measured latency, and the classic
/// critical-path table of the smallest size.
pub fn render_table(r: &AnatomyReport) -> String {
    let mut out = String::new();
    let m = &r.machine;
    let _ = writeln!(
        out,
        "strait anatomy — {} ({} cores, Linux {}), {}, TSC {}",
        m.cpu_model,
        m.cores,
        m.kernel,
        m.timestamp,
        m.tsc_ghz.map_or("n/a".into(), |g| format!("{g:.3} GHz"))
    );
    if r.probe_cost_back_to_back_ns > 0.0 {
        let _ = writeln!(
            out,
            "probe cost: {:.1} ns ({:.0} cycles) per probe on the path (median over sizes; {:.1} ns back to back), \
             measured and subtracted from every interval",
            r.probe_cost_ns, r.probe_cost_cycles, r.probe_cost_back_to_back_ns
        );
    }
    for t in r.transports() {
        let runs: Vec<&AnatomyRun> = r.runs.iter().filter(|x| x.transport == t).collect();
        let mut names: Vec<(String, String, bool)> = Vec::new();
        for run in &runs {
            for s in &run.stages {
                if !names.iter().any(|n| n.0 == s.name) {
                    names.push((s.name.clone(), s.layer.clone(), s.on_critical_path));
                }
            }
        }
        let w0 = names.iter().map(|n| n.0.len()).max().unwrap_or(10).max(34);
        let cw = 10;
        let _ = writeln!(out, "\n{t}: time per stage of one one-way message, ns (mean of the fastest half)");
        let _ = write!(out, "{:<w0$} {:<16}", "stage", "layer");
        for run in &runs {
            let _ = write!(out, "{}", pad(&format_size(run.size_bytes), cw));
        }
        let _ = writeln!(out);
        for (name, layer, crit) in &names {
            let label = if *crit { name.clone() } else { format!("({name})") };
            let _ = write!(out, "{label:<w0$} {layer:<16}");
            for run in &runs {
                let v = run
                    .stages
                    .iter()
                    .find(|s| &s.name == name)
                    .map_or("-".into(), |s| format!("{:.0}", s.ns));
                let _ = write!(out, "{}", pad(&v, cw));
            }
            let _ = writeln!(out);
        }
        let row = |out: &mut String, label: &str, f: &dyn Fn(&AnatomyRun) -> String| {
            let _ = write!(out, "{label:<w0$} {:<16}", "");
            for run in &runs {
                let _ = write!(out, "{}", pad(&f(run), cw));
            }
            let _ = writeln!(out);
        };
        row(&mut out, "= sum of stages", &|x| format!("{:.0}", x.stage_sum_ns));
        row(&mut out, "measured one-way (probes off)", &|x| format!("{:.0}", x.measured_one_way_ns));
        row(&mut out, "deviation", &|x| format!("{:+.1}%", x.deviation * 100.0));
        row(&mut out, "probe cost subtracted", &|x| format!("{:.0}", x.probe_overhead_ns));
        row(&mut out, "  per probe (on the path)", &|x| format!("{:.1}", x.probe_cost_ns));
        if runs.iter().any(|x| x.probe_cost_doubled_ns.is_some()) {
            row(&mut out, "  per probe (doubled probes)", &|x| {
                x.probe_cost_doubled_ns.map_or("-".into(), |v| format!("{v:.1}"))
            });
            row(&mut out, "deviation, doubled-probe cost", &|x| {
                x.deviation_doubled.map_or("-".into(), |v| format!("{:+.1}%", v * 100.0))
            });
        }
        row(&mut out, "one-way p50 (probed, corrected)", &|x| format!("{:.0}", x.total_p50_ns));
        if runs.iter().any(|x| x.wake_modes.is_some()) {
            row(&mut out, "receiver woken, traced / plain", &|x| match &x.wake_modes {
                Some(w) => match w.woken_plain {
                    Some(p) => format!("{:.0}%/{:.0}%", w.woken_traced * 100.0, p * 100.0),
                    // The untraced batches' mix is known only when the modes were told apart.
                    None => format!("{:.0}%/-", w.woken_traced * 100.0),
                },
                None => "-".into(),
            });
        }
        let bad: Vec<String> = runs
            .iter()
            .filter(|x| !x.within_tolerance)
            .map(|x| format!("{} ({:+.1}%)", format_size(x.size_bytes), x.deviation * 100.0))
            .collect();
        if bad.is_empty() {
            let _ = writeln!(
                out,
                "check: every size's stage sum is within {:.0}% (or {:.0} ns) of the one-way latency measured with probes off",
                r.tolerance * 100.0,
                r.tolerance_floor_ns
            );
        } else {
            let _ = writeln!(
                out,
                "check: stage sum NOT within {:.0}% (or {:.0} ns) of the measured one-way latency for: {}",
                r.tolerance * 100.0,
                r.tolerance_floor_ns,
                bad.join(", ")
            );
        }
        let _ = writeln!(out, "\n{t}: time per layer of one one-way message, ns (critical-path stages)");
        let _ = write!(out, "{:<w0$} {:<16}", "layer", "");
        for run in &runs {
            let _ = write!(out, "{}", pad(&format_size(run.size_bytes), cw));
        }
        let _ = writeln!(out);
        for layer in LAYERS {
            let _ = write!(out, "{layer:<w0$} {:<16}", "");
            for run in &runs {
                let _ = write!(out, "{}", pad(&format!("{:.0}", layer_ns(run, layer)), cw));
            }
            let _ = writeln!(out);
        }
        if let Some(first) = runs.first() {
            let _ = writeln!(out, "\n{t}, {}: critical path", format_size(first.size_bytes));
            let _ = writeln!(
                out,
                "{:<3} {:<w0$} {:<16} {:>9} {:>10} {:>7}",
                "#", "interval", "layer", "cycles", "µs", "% 1-way"
            );
            let mut i = 0;
            for s in &first.stages {
                let pct = if s.on_critical_path && first.stage_sum_ns > 0.0 {
                    format!("{:.1}", 100.0 * s.ns / first.stage_sum_ns)
                } else {
                    "-".into()
                };
                let num = if s.on_critical_path {
                    i += 1;
                    i.to_string()
                } else {
                    String::new()
                };
                let _ = writeln!(
                    out,
                    "{num:<3} {:<w0$} {:<16} {:>9.0} {:>10.3} {:>7}",
                    s.name,
                    s.layer,
                    s.cycles,
                    s.ns / 1e3,
                    pct
                );
            }
            let mut layers: Vec<(String, f64)> = Vec::new();
            for s in first.stages.iter().filter(|s| s.on_critical_path) {
                match layers.iter_mut().find(|l| l.0 == s.layer) {
                    Some(l) => l.1 += s.ns,
                    None => layers.push((s.layer.clone(), s.ns)),
                }
            }
            let by_layer: Vec<String> = layers.iter().map(|(l, ns)| format!("{l} {}", fmt_ns(*ns))).collect();
            let _ = writeln!(out, "by layer: {}", by_layer.join(" · "));
        }
    }
    render_layers(r, &mut out);
    for n in &r.notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}

/// The categories every stage belongs to, in report order.
pub const LAYERS: [&str; 6] =
    ["user", "protocol send", "protocol receive", "OS overhead", "copy", "device/wire"];

/// Time per layer (critical-path stages only), ns.
pub fn layer_ns(run: &AnatomyRun, layer: &str) -> f64 {
    // `+ 0.0`: an empty f64 sum is -0.0, which would print as "-0".
    run.stages.iter().filter(|s| s.on_critical_path && s.layer == layer).map(|s| s.ns).sum::<f64>() + 0.0
}

/// Side by side across transports, for every size measured on more than one: the
/// time of each layer of the one-way path.
fn render_layers(r: &AnatomyReport, out: &mut String) {
    let transports = r.transports();
    if transports.len() < 2 {
        return;
    }
    let mut sizes: Vec<u64> = r.runs.iter().map(|x| x.size_bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for size in sizes {
        let runs: Vec<&AnatomyRun> = r.runs.iter().filter(|x| x.size_bytes == size).collect();
        if runs.len() < 2 {
            continue;
        }
        let _ = writeln!(out, "\nby layer, {} one-way (ns):", format_size(size));
        let _ = write!(out, "{:<18}", "layer");
        for x in &runs {
            let _ = write!(out, "{:>14}", x.transport);
        }
        let _ = writeln!(out);
        for layer in LAYERS {
            let _ = write!(out, "{layer:<18}");
            for x in &runs {
                let _ = write!(out, "{:>14.0}", layer_ns(x, layer));
            }
            let _ = writeln!(out);
        }
        let _ = write!(out, "{:<18}", "= one-way");
        for x in &runs {
            let _ = write!(out, "{:>14.0}", x.stage_sum_ns);
        }
        let _ = writeln!(out);
    }
}

/// One-way latency against message size, log-log, one line per transport (the
/// stage sum; dots: measured without probes).
pub fn render_latency_svg(r: &AnatomyReport) -> String {
    const W: f64 = 640.0;
    const H: f64 = 420.0;
    let (l, t, pw, ph) = (70.0, 50.0, 400.0, 300.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="20" y="24" font-size="14" font-weight="bold">strait anatomy — one-way latency vs message size</text>"#
    );
    let pos = |v: f64| v > 0.0 && v.is_finite();
    let xs: Vec<f64> = r.runs.iter().map(|x| x.size_bytes as f64).filter(|v| pos(*v)).collect();
    let ys: Vec<f64> =
        r.runs.iter().flat_map(|x| [x.stage_sum_ns, x.measured_one_way_ns]).filter(|v| pos(*v)).collect();
    if xs.is_empty() || ys.is_empty() {
        let _ = writeln!(s, r#"<text x="{l}" y="{}">no data</text></svg>"#, t + 20.0);
        return s;
    }
    let lg = |v: f64| v.log10();
    let (x0, x1) = (
        lg(xs.iter().copied().fold(f64::MAX, f64::min)).floor(),
        lg(xs.iter().copied().fold(0.0, f64::max)).ceil().max(1.0),
    );
    let (y0, y1) = (
        lg(ys.iter().copied().fold(f64::MAX, f64::min)).floor(),
        lg(ys.iter().copied().fold(0.0, f64::max)).ceil(),
    );
    let (x1, y1) = (if x1 <= x0 { x0 + 1.0 } else { x1 }, if y1 <= y0 { y0 + 1.0 } else { y1 });
    let px = |v: f64| l + (lg(v) - x0) / (x1 - x0) * pw;
    let py = |v: f64| t + ph - (lg(v) - y0) / (y1 - y0) * ph;
    let _ = writeln!(s, r#"<rect x="{l}" y="{t}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#);
    let mut e = y0 as i32;
    while e <= y1 as i32 {
        let y = py(10f64.powi(e));
        let _ = writeln!(
            s,
            r##"<line x1="{l}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            l + pw,
            l - 4.0,
            y + 4.0,
            xml_escape(&fmt_ns(10f64.powi(e)))
        );
        e += 1;
    }
    let mut sizes: Vec<u64> = r.runs.iter().map(|x| x.size_bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for sz in &sizes {
        let x = px(*sz as f64);
        let _ = writeln!(
            s,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            t + ph + 16.0,
            xml_escape(&format_size(*sz))
        );
    }
    for (i, tr) in r.transports().iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<String> = r
            .runs
            .iter()
            .filter(|x| &x.transport == tr && pos(x.stage_sum_ns))
            .map(|x| format!("{:.1},{:.1}", px(x.size_bytes as f64), py(x.stage_sum_ns)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        for x in r.runs.iter().filter(|x| &x.transport == tr && pos(x.measured_one_way_ns)) {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                px(x.size_bytes as f64),
                py(x.measured_one_way_ns)
            );
        }
        let ly = t + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            l + pw + 15.0,
            l + pw + 35.0,
            l + pw + 40.0,
            ly + 4.0,
            xml_escape(tr)
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{l}" y="{:.1}">line: sum of stages; dot: measured with probes off</text>"#,
        t + ph + 36.0
    );
    let _ = writeln!(s, "</svg>");
    s
}

const COLORS: [&str; 12] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf", "#393b79", "#637939",
];

/// A distinct colour for stage `k` of `n`: hues around the wheel, alternating
/// lightness so that neighbours in a bar differ.
fn stage_color(k: usize, n: usize) -> String {
    let hue = 360.0 * k as f64 / n.max(1) as f64;
    let light = if k.is_multiple_of(2) { 45 } else { 65 };
    format!("hsl({hue:.0},65%,{light}%)")
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Stacked bars, one per transport and size: each critical-path stage's share of
/// the one-way latency (bars have equal height; the total is printed on top), with
/// a legend of stages.
pub fn render_svg(r: &AnatomyReport) -> String {
    let runs = &r.runs;
    let mut names: Vec<String> = Vec::new();
    for run in runs {
        for s in run.stages.iter().filter(|s| s.on_critical_path) {
            if !names.contains(&s.name) {
                names.push(s.name.clone());
            }
        }
    }
    let bw = 46.0;
    let gap = 22.0;
    let left = 60.0;
    let top: f64 = 60.0;
    let ph = 320.0;
    let legend_w = 300.0;
    let w = left + runs.len() as f64 * (bw + gap) + legend_w + 40.0;
    let h = (top + ph + 70.0).max(top + 18.0 * names.len() as f64 + 20.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect x="0" y="0" width="{w}" height="{h}" fill="white"/>"#);
    let m = &r.machine;
    let _ = writeln!(
        s,
        r#"<text x="20" y="22" font-size="14" font-weight="bold">strait anatomy — share of one-way latency per stage ({}, Linux {})</text>"#,
        xml_escape(&m.cpu_model),
        xml_escape(&m.kernel)
    );
    let _ = writeln!(
        s,
        r#"<text x="20" y="40">bars: 100 % = the stage sum; number on top: one-way latency (probe cost {:.1} ns/probe subtracted)</text>"#,
        r.probe_cost_ns
    );
    for (i, run) in runs.iter().enumerate() {
        let x = left + i as f64 * (bw + gap);
        let total: f64 = run.stages.iter().filter(|s| s.on_critical_path).map(|s| s.ns).sum();
        let mut y = top + ph;
        for st in run.stages.iter().filter(|s| s.on_critical_path) {
            let k = names.iter().position(|n| n == &st.name).unwrap_or(0);
            let fill = stage_color(k, names.len());
            let hh = if total > 0.0 { ph * st.ns / total } else { 0.0 };
            y -= hh;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{bw}" height="{hh:.2}" fill="{fill}"><title>{} {}: {} ({:.1} %)</title></rect>"#,
                xml_escape(&run.transport),
                xml_escape(&format_size(run.size_bytes)),
                xml_escape(&format!("{}: {}", st.name, fmt_ns(st.ns))),
                if total > 0.0 { 100.0 * st.ns / total } else { 0.0 }
            );
        }
        let cx = x + bw / 2.0;
        let _ = writeln!(
            s,
            r#"<text x="{cx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            top - 4.0,
            xml_escape(&fmt_ns(run.stage_sum_ns))
        );
        let _ = writeln!(
            s,
            r#"<text x="{cx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            top + ph + 16.0,
            xml_escape(&format_size(run.size_bytes))
        );
        let _ = writeln!(
            s,
            r#"<text x="{cx:.1}" y="{:.1}" text-anchor="middle" font-size="9">{}</text>"#,
            top + ph + 30.0,
            xml_escape(&run.transport)
        );
    }
    let lx = left + runs.len() as f64 * (bw + gap) + 20.0;
    for (k, n) in names.iter().enumerate() {
        let y = top + 18.0 * k as f64;
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{y:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            stage_color(k, names.len()),
            lx + 18.0,
            y + 10.0,
            xml_escape(n)
        );
    }
    let _ = writeln!(s, "</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AnatomyReport {
        let machine = MachineInfo {
            cpu_model: "cpu".into(),
            cores: 2,
            kernel: "6.18".into(),
            hostname: "h".into(),
            tsc_ghz: Some(2.5),
            timestamp: "2026-01-01T00:00:00Z".into(),
            command: "strait anatomy".into(),
            clock_source: "tsc".into(),
            clock_overhead_ns: 10.0,
            syscall_counter: String::new(),
        };
        let stage = |name: &str, ns: f64, crit: bool| StageRow {
            name: name.into(),
            layer: "copy".into(),
            ns,
            p50_ns: ns,
            p99_ns: ns * 2.0,
            cycles: ns * 2.5,
            on_critical_path: crit,
            raw_ns: None,
        };
        let run = |size: u64| AnatomyRun {
            transport: "strait-shm".into(),
            size_bytes: size,
            measured_one_way_ns: 100.0,
            stage_sum_ns: 95.0,
            total_p50_ns: 94.0,
            probed_one_way_ns: 150.0,
            probe_overhead_ns: 55.0,
            probe_cost_ns: 8.0,
            probe_cost_doubled_ns: Some(9.0),
            deviation_doubled: Some(-0.1),
            deviation: -0.05,
            within_tolerance: true,
            samples: 10,
            stages: vec![stage("a", 60.0, true), stage("b", 35.0, true), stage("bell", 9.0, false)],
            wake_modes: None,
        };
        AnatomyReport {
            machine,
            probe_cost_ns: 8.0,
            probe_cost_cycles: 20.0,
            probe_cost_back_to_back_ns: 12.0,
            tolerance: 0.1,
            tolerance_floor_ns: TOLERANCE_FLOOR_NS,
            runs: vec![run(8), run(4096)],
            notes: vec!["kernel paths: not measured".into()],
        }
    }

    #[test]
    fn json_round_trips() {
        let r = sample();
        assert_eq!(AnatomyReport::from_json(&r.to_json()).expect("parse"), r);
    }

    #[test]
    fn table_and_svg_show_every_stage_and_size() {
        let r = sample();
        let t = render_table(&r);
        for needle in ["4K", "(bell)", "= sum of stages", "within 10%", "critical path", "note: kernel"] {
            assert!(t.contains(needle), "table lacks {needle:?}:\n{t}");
        }
        let svg = render_svg(&r);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        let lat = render_latency_svg(&r);
        assert!(lat.contains("<polyline") && lat.matches("<circle").count() == 2);
        let mut two = r.clone();
        for x in &mut two.runs.clone() {
            x.transport = "kernel-udp".into();
            two.runs.push(x.clone());
        }
        let t = render_table(&two);
        assert!(t.contains("by layer, 8 one-way") && t.contains("kernel-udp"), "{t}");
        assert_eq!(svg.matches("<title>").count(), 4, "two critical stages per bar, two bars");
    }
}
