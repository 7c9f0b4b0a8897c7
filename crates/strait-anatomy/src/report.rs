//! Benchmark results: the JSON document, the human table and the SVG chart.
//!
//! # JSON schema (`strait bench --format json`, and `bench.json`)
//!
//! ```text
//! {
//!   "machine": {
//!     "cpu_model": "AMD EPYC ...",        // /proc/cpuinfo "model name"
//!     "cores": 2,                          // online CPUs
//!     "kernel": "6.18.0",                  // uname release
//!     "hostname": "...",
//!     "tsc_ghz": 2.596,                    // calibrated TSC rate; null if the clock fell back to CLOCK_MONOTONIC
//!     "timestamp": "2025-01-01T12:00:00Z", // UTC start of the run
//!     "command": "strait bench ...",       // command line that reproduces the run
//!     "clock_source": "tsc",               // extra: "tsc" or "clock_gettime(CLOCK_MONOTONIC)"
//!     "clock_overhead_ns": 12.0,           // extra: cost of one timestamp
//!     "syscall_counter": "perf ..."        // extra: how syscalls were counted, or why they were not
//!   },
//!   "results": [ {
//!     "transport": "strait-shm",           // strait-shm, kernel-tcp, kernel-udp, unix-stream, pipe, spin-floor, ...
//!     "kind": "latency",                   // "latency" | "bandwidth"
//!     "size_bytes": 8,
//!     "p50_ns": 250.0,                     // latency: one-way = round trip / 2, over per-iteration samples
//!     "p99_ns": 400.0,                     // bandwidth: time per delivered message, per batch (percentiles over batches)
//!     "p999_ns": 900.0,
//!     "gbytes_per_s": null,                // bandwidth only: 1e9 bytes/s of delivered payload, median batch
//!     "syscalls_per_msg": 0.0,             // both processes, per one-way message, from a separate counted pass
//!     "cpu_ns_per_msg": 500.0,             // both processes' CPU time, per one-way message
//!     "samples": 50000,                    // latency: iterations; bandwidth: batches
//!     "note": null                         // extra: why skipped/failed, or how it was run (e.g. datagram split)
//!   } ],
//!   "transports": [ {                      // extra: what was compared
//!     "name": "spin-floor", "description": "...", "busy_poll": true
//!   } ]
//! }
//! ```
//!
//! A ping-pong iteration carries two one-way messages, so per-message counts of a
//! latency row are per iteration / 2. Fields that do not apply, or could not be
//! measured, are `null`.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::size::{format_size, human_size};

/// Which measurement a row holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Ping-pong, one-way latency.
    Latency,
    /// Streaming throughput.
    Bandwidth,
}

impl Kind {
    /// `"latency"` or `"bandwidth"`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Latency => "latency",
            Kind::Bandwidth => "bandwidth",
        }
    }
}

/// The fields every [`ResultRow`] has in the JSON report (null where not measured):
/// its schema, for the report's readers and tests.
pub const RESULT_FIELDS: [&str; 10] = [
    "transport",
    "kind",
    "size_bytes",
    "p50_ns",
    "p99_ns",
    "p999_ns",
    "gbytes_per_s",
    "syscalls_per_msg",
    "cpu_ns_per_msg",
    "samples",
];

/// One (transport, kind, size) result. See the module docs for field meanings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRow {
    /// Transport name.
    pub transport: String,
    /// Latency or bandwidth.
    pub kind: Kind,
    /// Message size in bytes.
    pub size_bytes: u64,
    /// Median (latency: one-way; bandwidth: per message), ns.
    pub p50_ns: Option<f64>,
    /// 99th percentile, ns.
    pub p99_ns: Option<f64>,
    /// 99.9th percentile, ns.
    pub p999_ns: Option<f64>,
    /// Delivered payload throughput, 1e9 bytes/s (bandwidth rows).
    pub gbytes_per_s: Option<f64>,
    /// System calls per one-way message, both processes.
    pub syscalls_per_msg: Option<f64>,
    /// CPU ns per one-way message, both processes.
    pub cpu_ns_per_msg: Option<f64>,
    /// Number of timing samples behind the percentiles.
    pub samples: u64,
    /// Why the row is empty, or how it was measured.
    #[serde(default)]
    pub note: Option<String>,
}

impl ResultRow {
    /// A row with no measurements.
    pub fn empty(transport: &str, kind: Kind, size: u64) -> ResultRow {
        ResultRow {
            transport: transport.to_owned(),
            kind,
            size_bytes: size,
            p50_ns: None,
            p99_ns: None,
            p999_ns: None,
            gbytes_per_s: None,
            syscalls_per_msg: None,
            cpu_ns_per_msg: None,
            samples: 0,
            note: None,
        }
    }
}

/// The machine and the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineInfo {
    /// CPU model name.
    pub cpu_model: String,
    /// Online CPUs.
    pub cores: u32,
    /// Kernel release.
    pub kernel: String,
    /// Host name.
    pub hostname: String,
    /// TSC rate in GHz, or null without an invariant TSC.
    pub tsc_ghz: Option<f64>,
    /// UTC time the run started (RFC 3339).
    pub timestamp: String,
    /// Command line that reproduces the run.
    pub command: String,
    /// Timestamp source.
    #[serde(default)]
    pub clock_source: String,
    /// Cost of one timestamp, ns.
    #[serde(default)]
    pub clock_overhead_ns: f64,
    /// How system calls were counted, or why they were not.
    #[serde(default)]
    pub syscall_counter: String,
}

impl MachineInfo {
    /// Facts about this machine, with the given run details.
    pub fn collect(
        clock: &crate::clock::Clock,
        timestamp: String,
        command: String,
        syscall_counter: String,
    ) -> Self {
        let (kernel, hostname) = crate::sys::uname();
        MachineInfo {
            cpu_model: crate::sys::cpu_model(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            kernel,
            hostname,
            tsc_ghz: clock.tsc_ghz(),
            timestamp,
            command,
            clock_source: clock.source().name().to_owned(),
            clock_overhead_ns: clock.overhead_ns(),
            syscall_counter,
        }
    }
}

/// What was compared: one entry per transport of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransportInfo {
    /// Transport name, as in the result rows.
    pub name: String,
    /// The mechanism, in one line.
    pub description: String,
    /// True if it busy-polls (its CPU per message includes spinning).
    pub busy_poll: bool,
    /// What the transport chose on this host for settings left to it, and why (e.g.
    /// the shm device's rendezvous path from its calibration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<String>,
}

/// A whole run: what `--format json` prints and `bench.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// Machine and run details.
    pub machine: MachineInfo,
    /// One row per (transport, kind, size).
    pub results: Vec<ResultRow>,
    /// Extra: the transports compared, in order.
    #[serde(default)]
    pub transports: Vec<TransportInfo>,
}

impl BenchReport {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        // Serialising plain structs of strings and numbers cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Parses a report.
    pub fn from_json(text: &str) -> Result<BenchReport, serde_json::Error> {
        serde_json::from_str(text)
    }

    fn find(&self, transport: &str, kind: Kind, size: u64) -> Option<&ResultRow> {
        self.results.iter().find(|r| r.transport == transport && r.kind == kind && r.size_bytes == size)
    }

    fn sizes(&self, kind: Kind) -> Vec<u64> {
        let mut v: Vec<u64> = self.results.iter().filter(|r| r.kind == kind).map(|r| r.size_bytes).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    fn transports(&self) -> Vec<&str> {
        let mut v: Vec<&str> = Vec::new();
        for r in &self.results {
            if !v.contains(&r.transport.as_str()) {
                v.push(&r.transport);
            }
        }
        v
    }
}

/// Seconds since the Unix epoch to (year, month, day, hour, minute, second), UTC.
pub fn utc_parts(secs: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, (rem / 3600) as u32, (rem % 3600 / 60) as u32, (rem % 60) as u32)
}

/// `2025-01-01T12:00:00Z`.
pub fn rfc3339(secs: u64) -> String {
    let (y, mo, d, h, mi, s) = utc_parts(secs);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

/// `20250101T120000Z`, for directory names.
pub fn compact_stamp(secs: u64) -> String {
    let (y, mo, d, h, mi, s) = utc_parts(secs);
    format!("{y:04}{mo:02}{d:02}T{h:02}{mi:02}{s:02}Z")
}

/// A duration in ns, compactly: `183 ns`, `12.4 µs`, `1.35 ms`.
pub fn fmt_ns(ns: f64) -> String {
    if !ns.is_finite() {
        "-".into()
    } else if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e5 {
        format!("{:.2} µs", ns / 1e3)
    } else if ns < 1e6 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

/// Label of the decade 10^e ns: `1 ns`, `100 ns`, `10 µs`, `1 s`.
fn decade_ns(e: i32) -> String {
    let units = [(9, "s"), (6, "ms"), (3, "µs"), (0, "ns")];
    for (u, name) in units {
        if e >= u {
            return format!("{} {name}", 10u64.pow((e - u) as u32));
        }
    }
    format!("{} ns", 10f64.powi(e))
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".into(), f)
}

/// The reference transports ratios are computed against.
pub const REF_KERNEL: &str = "kernel-tcp";
/// The physical floor.
pub const REF_FLOOR: &str = "spin-floor";

/// Renders the human-readable tables.
pub fn render_table(report: &BenchReport) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let _ = writeln!(
        out,
        "strait bench  {}  {} cores  Linux {}  {}  clock {}{}",
        m.cpu_model,
        m.cores,
        m.kernel,
        m.timestamp,
        m.clock_source,
        m.tsc_ghz.map_or(String::new(), |g| format!(" {g:.3} GHz")),
    );
    let mut notes: Vec<String> = Vec::new();
    let note_ref = |r: &ResultRow, notes: &mut Vec<String>| -> String {
        match &r.note {
            Some(n) => {
                notes.push(format!(
                    "[{}] {} {} {}: {n}",
                    notes.len() + 1,
                    r.transport,
                    r.kind.name(),
                    human_size(r.size_bytes)
                ));
                format!(" [{}]", notes.len())
            }
            None => String::new(),
        }
    };
    let transports = report.transports();
    for kind in [Kind::Latency, Kind::Bandwidth] {
        let sizes = report.sizes(kind);
        if sizes.is_empty() {
            continue;
        }
        let _ = writeln!(out);
        match kind {
            Kind::Latency => {
                let _ = writeln!(out, "One-way latency (ping-pong round trip / 2), per-iteration samples pooled over interleaved rounds");
                let _ = writeln!(
                    out,
                    "{:>8}  {:<12} {:>10} {:>10} {:>10} {:>9} {:>10} {:>7} {:>8}",
                    "size", "transport", "p50", "p99", "p99.9", "sys/msg", "cpu ns/msg", "vs tcp", "vs floor"
                );
            }
            Kind::Bandwidth => {
                let _ = writeln!(
                    out,
                    "Streaming bandwidth (GB/s = 1e9 B/s delivered; median batch), per-message time p50/p99"
                );
                let _ = writeln!(
                    out,
                    "{:>8}  {:<12} {:>10} {:>10} {:>10} {:>9} {:>10} {:>7} {:>8}",
                    "size",
                    "transport",
                    "GB/s",
                    "p50/msg",
                    "p99/msg",
                    "sys/msg",
                    "cpu ns/msg",
                    "vs tcp",
                    "vs floor"
                );
            }
        }
        for &size in &sizes {
            let reference = |name: &str| report.find(name, kind, size);
            for &t in &transports {
                let Some(r) = report.find(t, kind, size) else { continue };
                let ratio = |base: Option<&ResultRow>| -> String {
                    let v = match kind {
                        Kind::Latency => base.and_then(|b| b.p50_ns).zip(r.p50_ns).map(|(b, x)| b / x),
                        Kind::Bandwidth => {
                            base.and_then(|b| b.gbytes_per_s).zip(r.gbytes_per_s).map(|(b, x)| x / b)
                        }
                    };
                    opt(v, |v| format!("{v:.2}x"))
                };
                let (c1, c2, c3) = match kind {
                    Kind::Latency => (opt(r.p50_ns, fmt_ns), opt(r.p99_ns, fmt_ns), opt(r.p999_ns, fmt_ns)),
                    Kind::Bandwidth => (
                        opt(r.gbytes_per_s, |g| format!("{g:.3}")),
                        opt(r.p50_ns, fmt_ns),
                        opt(r.p99_ns, fmt_ns),
                    ),
                };
                let nr = note_ref(r, &mut notes);
                let _ = writeln!(
                    out,
                    "{:>8}  {:<12} {:>10} {:>10} {:>10} {:>9} {:>10} {:>7} {:>8}{}",
                    format_size(size),
                    t,
                    c1,
                    c2,
                    c3,
                    opt(r.syscalls_per_msg, |s| format!("{s:.2}")),
                    opt(r.cpu_ns_per_msg, |c| format!("{c:.0}")),
                    ratio(reference(REF_KERNEL)),
                    ratio(reference(REF_FLOOR)),
                    nr,
                );
            }
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "vs tcp / vs floor: speed relative to {REF_KERNEL} / {REF_FLOOR} (latency: their p50 / this p50; bandwidth: this GB/s / theirs); >1 is faster."
    );
    let _ = writeln!(out, "sys/msg and cpu ns/msg: both processes, per one-way message (a ping-pong iteration is two); syscalls from a separate counted pass ({}).", m.syscall_counter);
    let polling: Vec<&str> =
        report.transports.iter().filter(|t| t.busy_poll).map(|t| t.name.as_str()).collect();
    if !polling.is_empty() {
        let _ = writeln!(
            out,
            "busy-polling (cpu ns/msg includes spinning): {}; the kernel paths block.",
            polling.join(", ")
        );
    }
    for t in &report.transports {
        if let Some(s) = &t.settings {
            let _ = writeln!(out, "{}: {s}", t.name);
        }
    }
    for n in notes {
        let _ = writeln!(out, "{n}");
    }
    out
}

const COLORS: [&str; 10] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#7f7f7f", "#ff7f0e", "#17becf", "#e377c2",
    "#bcbd22",
];

fn color_of(name: &str, index: usize) -> &'static str {
    match name {
        "strait-shm" => COLORS[0],
        "kernel-tcp" => COLORS[1],
        "kernel-udp" => COLORS[2],
        "unix-stream" => COLORS[3],
        "pipe" => COLORS[4],
        "spin-floor" => COLORS[5],
        _ => COLORS[6 + index % 4],
    }
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A log-scale axis range covering `values` (positive), widened to whole decades
/// (or whole powers of two for sizes).
fn log_range(values: &[f64], base: f64) -> (f64, f64) {
    let lo = values.iter().copied().filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().filter(|v| *v > 0.0).fold(0.0, f64::max);
    if !lo.is_finite() || hi <= 0.0 {
        return (1.0, base);
    }
    let (a, mut b) = (lo.log(base).floor(), hi.log(base).ceil());
    if b <= a {
        b = a + 1.0;
    }
    (base.powf(a), base.powf(b))
}

/// Renders the two-panel SVG chart: p50 one-way latency vs size and bandwidth vs
/// size, log-log, one line per transport, with a legend.
pub fn render_svg(report: &BenchReport) -> String {
    const W: f64 = 1100.0;
    const H: f64 = 500.0;
    const PW: f64 = 430.0;
    const PH: f64 = 340.0;
    let transports = report.transports();
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>"#);
    let m = &report.machine;
    let _ = writeln!(
        s,
        r#"<text x="20" y="24" font-size="15" font-weight="bold">strait bench — {} ({} cores, Linux {}) {}</text>"#,
        xml_escape(&m.cpu_model),
        m.cores,
        xml_escape(&m.kernel),
        xml_escape(&m.timestamp)
    );
    let panels = [
        (Kind::Latency, "one-way latency p50 (ns)", 70.0),
        (Kind::Bandwidth, "streaming bandwidth (GB/s)", 590.0),
    ];
    for (kind, title, x0) in panels {
        let y0 = 60.0;
        let rows: Vec<&ResultRow> = report.results.iter().filter(|r| r.kind == kind).collect();
        let value = |r: &ResultRow| match kind {
            Kind::Latency => r.p50_ns,
            Kind::Bandwidth => r.gbytes_per_s,
        };
        let xs: Vec<f64> = rows.iter().map(|r| r.size_bytes.max(1) as f64).collect();
        let ys: Vec<f64> = rows.iter().filter_map(|r| value(r)).collect();
        let (xlo, xhi) = log_range(&xs, 2.0);
        let (ylo, yhi) = log_range(&ys, 10.0);
        let px = |x: f64| x0 + (x.ln() - xlo.ln()) / (xhi.ln() - xlo.ln()) * PW;
        let py = |y: f64| y0 + PH - (y.ln() - ylo.ln()) / (yhi.ln() - ylo.ln()) * PH;
        let _ = writeln!(s, r#"<g class="panel" data-kind="{}">"#, kind.name());
        let _ = writeln!(
            s,
            r##"<rect x="{x0}" y="{y0}" width="{PW}" height="{PH}" fill="none" stroke="#333"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-weight="bold">{}</text>"#,
            x0 + PW / 2.0,
            y0 - 8.0,
            xml_escape(title)
        );
        // X ticks: every power of two in range, labelled every other when crowded.
        let (a, b) = (xlo.log2().round() as i32, xhi.log2().round() as i32);
        let step = if b - a > 12 { 2 } else { 1 };
        for e in (a..=b).step_by(step as usize) {
            let x = px(2f64.powi(e));
            let _ =
                writeln!(s, r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{}" stroke="#ddd"/>"##, y0 + PH);
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
                y0 + PH + 16.0,
                format_size(1u64 << e.clamp(0, 62))
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">message size (bytes)</text>"#,
            x0 + PW / 2.0,
            y0 + PH + 36.0
        );
        // Y ticks: decades.
        let (a, b) = (ylo.log10().round() as i32, yhi.log10().round() as i32);
        for e in a..=b {
            let v = 10f64.powi(e);
            let y = py(v);
            let label = if kind == Kind::Latency { decade_ns(e) } else { format!("{v}") };
            let _ =
                writeln!(s, r##"<line x1="{x0}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/>"##, x0 + PW);
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                x0 - 6.0,
                y + 4.0,
                xml_escape(&label)
            );
        }
        for (i, t) in transports.iter().enumerate() {
            let mut pts: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.transport == *t)
                .filter_map(|r| value(r).filter(|v| *v > 0.0).map(|v| (r.size_bytes.max(1) as f64, v)))
                .collect();
            pts.sort_by(|p, q| p.0.total_cmp(&q.0));
            if pts.is_empty() {
                continue;
            }
            let c = color_of(t, i);
            let dash = if *t == REF_FLOOR { r#" stroke-dasharray="6 4""# } else { "" };
            let coords: Vec<String> =
                pts.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
            let _ = writeln!(
                s,
                r#"<polyline data-transport="{}" fill="none" stroke="{c}" stroke-width="2"{dash} points="{}"/>"#,
                xml_escape(t),
                coords.join(" ")
            );
            for &(x, y) in &pts {
                let _ = writeln!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, px(x), py(y));
            }
        }
        let _ = writeln!(s, "</g>");
    }
    // Legend along the bottom.
    let mut lx = 70.0;
    let ly = H - 30.0;
    let _ = writeln!(s, r#"<g class="legend">"#);
    for (i, t) in transports.iter().enumerate() {
        let c = color_of(t, i);
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/>"#,
            lx + 24.0
        );
        let _ = writeln!(s, r#"<text x="{}" y="{}">{}</text>"#, lx + 30.0, ly + 4.0, xml_escape(t));
        lx += 40.0 + 8.0 * t.len() as f64;
    }
    let _ = writeln!(s, "</g>");
    let _ = writeln!(s, "</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_report() -> BenchReport {
        let machine = MachineInfo {
            cpu_model: "Test CPU <x>".into(),
            cores: 2,
            kernel: "6.18.0".into(),
            hostname: "box".into(),
            tsc_ghz: Some(2.5),
            timestamp: rfc3339(0),
            command: "strait bench".into(),
            clock_source: "tsc".into(),
            clock_overhead_ns: 10.0,
            syscall_counter: "perf".into(),
        };
        let mut results = Vec::new();
        for (i, t) in ["strait-shm", "kernel-tcp", "spin-floor"].iter().enumerate() {
            for &size in &[8u64, 4096, 1 << 20] {
                let mut r = ResultRow::empty(t, Kind::Latency, size);
                let base = 100.0 * (i + 1) as f64 * (size as f64).sqrt();
                r.p50_ns = Some(base);
                r.p99_ns = Some(base * 2.0);
                r.p999_ns = Some(base * 3.0);
                r.syscalls_per_msg = Some(i as f64);
                r.cpu_ns_per_msg = Some(base * 2.0);
                r.samples = 1000;
                results.push(r);
                let mut b = ResultRow::empty(t, Kind::Bandwidth, size * 128);
                b.gbytes_per_s = Some(1.0 + i as f64);
                b.p50_ns = Some(100.0);
                b.samples = 10;
                results.push(b);
            }
        }
        let mut skipped = ResultRow::empty("kernel-udp", Kind::Latency, 1 << 20);
        skipped.note = Some("skipped: too big".into());
        results.push(skipped);
        let transports = vec![TransportInfo {
            name: "spin-floor".into(),
            description: "floor".into(),
            busy_poll: true,
            settings: None,
        }];
        BenchReport { machine, results, transports }
    }

    #[test]
    fn json_round_trip_and_schema() {
        let r = sample_report();
        let text = r.to_json();
        assert_eq!(BenchReport::from_json(&text).unwrap(), r);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        for k in ["cpu_model", "cores", "kernel", "hostname", "tsc_ghz", "timestamp", "command"] {
            assert!(v["machine"].get(k).is_some(), "machine.{k} missing");
        }
        let row = &v["results"][0];
        for k in RESULT_FIELDS {
            assert!(row.get(k).is_some(), "result.{k} missing");
        }
        assert_eq!(row["kind"], "latency");
        assert!(row["gbytes_per_s"].is_null());
        let last = v["results"].as_array().unwrap().last().unwrap();
        assert!(last["p50_ns"].is_null());
        assert_eq!(last["note"], "skipped: too big");
    }

    #[test]
    fn svg_has_both_panels_lines_and_legend() {
        let svg = render_svg(&sample_report());
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches(r#"class="panel""#).count(), 2);
        // 3 transports with data in each panel; kernel-udp has no points.
        assert_eq!(svg.matches("<polyline").count(), 6);
        assert!(svg.contains(r#"data-transport="strait-shm""#));
        assert!(svg.contains(">kernel-udp</text>"), "legend lists every transport");
        assert!(svg.contains("Test CPU &lt;x&gt;"), "text is escaped");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        // Every opened element is closed: count tags.
        assert_eq!(svg.matches("<g ").count(), svg.matches("</g>").count());
        for line in svg.lines().filter(|l| l.starts_with("<polyline") || l.starts_with("<circle")) {
            assert!(line.ends_with("/>"), "{line}");
        }
    }

    #[test]
    fn table_has_ratios_and_notes() {
        let t = render_table(&sample_report());
        assert!(t.contains("strait-shm"));
        assert!(t.contains("1.00x"), "kernel-tcp vs itself");
        assert!(t.contains("2.00x"), "strait-shm is twice as fast as tcp in the sample");
        assert!(t.contains("skipped: too big"));
        assert!(t.contains("busy-polling (cpu ns/msg includes spinning): spin-floor"));
    }

    #[test]
    fn utc_formatting() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_735_732_800), "2025-01-01T12:00:00Z");
        assert_eq!(compact_stamp(1_735_732_800), "20250101T120000Z");
    }

    #[test]
    fn ns_formatting() {
        assert_eq!(fmt_ns(183.4), "183 ns");
        assert_eq!(fmt_ns(12_345.0), "12.35 µs");
        assert_eq!(fmt_ns(1_350_000.0), "1.35 ms");
        assert_eq!(decade_ns(2), "100 ns");
        assert_eq!(decade_ns(4), "10 µs");
        assert_eq!(decade_ns(9), "1 s");
    }
}
