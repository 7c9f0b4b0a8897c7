//! SVG plots of predicted curves beside measured points: one-way latency and
//! streaming bandwidth against message size, log scales (the style of
//! `strait bench`'s plot).

use std::fmt::Write;

use crate::data::Metric;

/// One curve or point set.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend label.
    pub label: String,
    /// Which panel.
    pub metric: Metric,
    /// `(size bytes, value)`: ns for latency, GB/s for bandwidth.
    pub points: Vec<(u64, f64)>,
    /// Measured points (dots) rather than a predicted curve (line).
    pub measured: bool,
    /// Colour index (series with the same index share a colour).
    pub colour: usize,
}

const PALETTE: [&str; 8] =
    ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn size_label(b: u64) -> String {
    if b >= 1 << 30 && b.is_multiple_of(1 << 30) {
        format!("{}G", b >> 30)
    } else if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{}M", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{}K", b >> 10)
    } else {
        b.to_string()
    }
}

fn ns_label(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{} µs", ns / 1e3)
    } else {
        format!("{ns} ns")
    }
}

fn log_range(v: &[f64], pad: f64) -> (f64, f64) {
    let lo = v.iter().copied().filter(|x| *x > 0.0).fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().filter(|x| *x > 0.0).fold(0.0, f64::max);
    if !lo.is_finite() || hi <= 0.0 {
        return (1.0, 10.0);
    }
    let (lo, hi) = (lo / pad.sqrt(), hi * pad.sqrt());
    if hi / lo < 10.0 {
        (lo / 2.0, hi * 2.0)
    } else {
        (lo, hi)
    }
}

/// Renders both panels with a legend; `title` goes on top.
pub fn render_svg(title: &str, series: &[Series]) -> String {
    const W: f64 = 1100.0;
    const H: f64 = 520.0;
    const PW: f64 = 430.0;
    const PH: f64 = 340.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>"#);
    let _ =
        writeln!(s, r#"<text x="20" y="24" font-size="15" font-weight="bold">{}</text>"#, xml_escape(title));
    for (metric, name, x0) in [
        (Metric::Latency, "one-way latency: model lines, measured dots", 70.0),
        (Metric::Bandwidth, "streaming bandwidth (GB/s = 1e9 B/s): model lines, measured dots", 600.0),
    ] {
        let y0 = 60.0;
        let ser: Vec<&Series> =
            series.iter().filter(|x| x.metric == metric && !x.points.is_empty()).collect();
        let xs: Vec<f64> = ser.iter().flat_map(|x| x.points.iter().map(|p| p.0.max(1) as f64)).collect();
        let ys: Vec<f64> = ser.iter().flat_map(|x| x.points.iter().map(|p| p.1)).collect();
        let (xlo, xhi) = log_range(&xs, 2.0);
        let (ylo, yhi) = log_range(&ys, 1.5);
        let px = |x: f64| x0 + (x.ln() - xlo.ln()) / (xhi.ln() - xlo.ln()) * PW;
        let py = |y: f64| y0 + PH - (y.ln() - ylo.ln()) / (yhi.ln() - ylo.ln()) * PH;
        let _ = writeln!(s, r#"<g class="panel" data-metric="{}">"#, metric.name());
        let _ = writeln!(
            s,
            r##"<rect x="{x0}" y="{y0}" width="{PW}" height="{PH}" fill="none" stroke="#333"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-weight="bold">{}</text>"#,
            x0 + PW / 2.0,
            y0 - 8.0,
            xml_escape(name)
        );
        let (a, b) = (xlo.log2().ceil() as i32, xhi.log2().floor() as i32);
        let step = if b - a > 12 { 2 } else { 1 };
        for e in (a..=b).step_by(step) {
            let x = px(2f64.powi(e));
            let _ =
                writeln!(s, r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{}" stroke="#ddd"/>"##, y0 + PH);
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
                y0 + PH + 16.0,
                size_label(1u64 << e.clamp(0, 62))
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">message size (bytes)</text>"#,
            x0 + PW / 2.0,
            y0 + PH + 36.0
        );
        // Y ticks: decades, and 2× / 5× when fewer than three decades show.
        let (a, b) = (ylo.log10().floor() as i32, yhi.log10().ceil() as i32);
        let mults: &[f64] = if b - a < 3 { &[1.0, 2.0, 5.0] } else { &[1.0] };
        for e in a..=b {
            for &m in mults {
                let v = m * 10f64.powi(e);
                if v < ylo || v > yhi {
                    continue;
                }
                let y = py(v);
                let label = match metric {
                    Metric::Latency => ns_label(v),
                    Metric::Bandwidth => format!("{v}"),
                };
                let _ = writeln!(
                    s,
                    r##"<line x1="{x0}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/>"##,
                    x0 + PW
                );
                let _ = writeln!(
                    s,
                    r#"<text x="{}" y="{:.1}" text-anchor="end">{label}</text>"#,
                    x0 - 6.0,
                    y + 4.0
                );
            }
        }
        for x in &ser {
            let c = PALETTE[x.colour % PALETTE.len()];
            let mut pts: Vec<(f64, f64)> =
                x.points.iter().filter(|p| p.1 > 0.0).map(|p| (p.0.max(1) as f64, p.1)).collect();
            pts.sort_by(|p, q| p.0.total_cmp(&q.0));
            if x.measured {
                for &(a, b) in &pts {
                    let _ = writeln!(
                        s,
                        r##"<circle data-series="{}" cx="{:.1}" cy="{:.1}" r="3.5" fill="{c}" stroke="#000" stroke-width="0.5"/>"##,
                        xml_escape(&x.label),
                        px(a),
                        py(b)
                    );
                }
            } else {
                let coords: Vec<String> =
                    pts.iter().map(|&(a, b)| format!("{:.1},{:.1}", px(a), py(b))).collect();
                let _ = writeln!(
                    s,
                    r#"<polyline data-series="{}" fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
                    xml_escape(&x.label),
                    coords.join(" ")
                );
            }
        }
        let _ = writeln!(s, "</g>");
    }
    // Legend.
    let mut lx = 70.0;
    let mut ly = H - 50.0;
    let _ = writeln!(s, r#"<g class="legend">"#);
    for x in series.iter().filter(|x| !x.points.is_empty()) {
        if x.metric == Metric::Bandwidth
            && series.iter().any(|y| y.metric == Metric::Latency && y.label == x.label)
        {
            continue; // one legend entry per label
        }
        let c = PALETTE[x.colour % PALETTE.len()];
        if x.measured {
            let _ = writeln!(s, r#"<circle cx="{}" cy="{ly}" r="4" fill="{c}"/>"#, lx + 12.0);
        } else {
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/>"#,
                lx + 24.0
            );
        }
        let _ = writeln!(s, r#"<text x="{}" y="{}">{}</text>"#, lx + 30.0, ly + 4.0, xml_escape(&x.label));
        lx += 40.0 + 7.0 * x.label.len() as f64;
        if lx > W - 200.0 {
            lx = 70.0;
            ly += 20.0;
        }
    }
    let _ = writeln!(s, "</g>\n</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_lines_and_dots() {
        let s = render_svg(
            "t <&>",
            &[
                Series {
                    label: "model".into(),
                    metric: Metric::Latency,
                    points: vec![(4096, 600.0), (1 << 20, 6e4)],
                    measured: false,
                    colour: 0,
                },
                Series {
                    label: "measured".into(),
                    metric: Metric::Latency,
                    points: vec![(4096, 620.0), (1 << 20, 5.9e4)],
                    measured: true,
                    colour: 0,
                },
                Series {
                    label: "model".into(),
                    metric: Metric::Bandwidth,
                    points: vec![(4096, 10.0), (1 << 20, 15.0)],
                    measured: false,
                    colour: 0,
                },
            ],
        );
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("t &lt;&amp;&gt;"));
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.matches("<circle").count() >= 2);
        // Empty input still renders a valid document.
        assert!(render_svg("empty", &[]).contains("</svg>"));
    }
}
