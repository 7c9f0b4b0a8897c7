//! Measurements the model is fitted to and checked against: the JSON documents of
//! `strait bench` and `strait anatomy`, read leniently (only the fields used here).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ModelError;

/// What a measurement measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    /// One-way latency, ns.
    Latency,
    /// Streaming bandwidth, GB/s (10⁹ bytes per second = bytes per ns).
    Bandwidth,
}

impl Metric {
    /// `latency` or `bandwidth`.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Latency => "latency",
            Metric::Bandwidth => "bandwidth",
        }
    }
}

/// One measured value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// Transport (path) name, as in `strait bench`.
    pub path: String,
    /// What was measured.
    pub metric: Metric,
    /// Message size, bytes.
    pub size_bytes: u64,
    /// One-way latency in ns (p50), or bandwidth in GB/s.
    pub value: f64,
}

impl Point {
    /// The time per message: the latency itself, or `B / bandwidth` for a bandwidth, ns.
    pub fn time_ns(&self) -> f64 {
        match self.metric {
            Metric::Latency => self.value,
            Metric::Bandwidth => self.size_bytes as f64 / self.value,
        }
    }
}

/// A `strait bench` document, reduced to what the model uses.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BenchData {
    /// The `STRAIT_*` variables of the run (from the reproducing command line).
    pub env: Vec<(String, String)>,
    /// Every measured cell (cells without a value, e.g. skipped ones, are left out).
    pub points: Vec<Point>,
}

impl BenchData {
    /// Value of a `STRAIT_*` variable of the run.
    pub fn env(&self, key: &str) -> Option<&str> {
        self.env.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

fn field<'a>(v: &'a Value, k: &str, what: &str) -> Result<&'a Value, ModelError> {
    v.get(k).ok_or_else(|| ModelError::Input(format!("{what} has no field {k:?}")))
}

fn as_u64(v: &Value, k: &str, what: &str) -> Result<u64, ModelError> {
    field(v, k, what)?
        .as_u64()
        .ok_or_else(|| ModelError::Input(format!("{what}: {k} is not an unsigned integer")))
}

fn as_str<'a>(v: &'a Value, k: &str, what: &str) -> Result<&'a str, ModelError> {
    field(v, k, what)?.as_str().ok_or_else(|| ModelError::Input(format!("{what}: {k} is not a string")))
}

/// Undoes the shell quoting of `strait bench`'s reproducing command (`'...'` with
/// `'\''` for a quote) for one word.
fn unquote(w: &str) -> String {
    w.replace(r"'\''", "'").replace('\'', "")
}

/// The leading `KEY=VALUE` words of a reproducing command line.
pub fn env_of_command(cmd: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for w in cmd.split_whitespace() {
        match w.split_once('=') {
            Some((k, v))
                if k.starts_with("STRAIT_") && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
            {
                out.push((k.to_owned(), unquote(v)))
            }
            _ => break,
        }
    }
    out
}

/// Reads a `strait bench --format json` document.
pub fn parse_bench(text: &str) -> Result<BenchData, ModelError> {
    let doc: Value = serde_json::from_str(text).map_err(|e| ModelError::Input(format!("not JSON: {e}")))?;
    let results = field(&doc, "results", "bench document")?
        .as_array()
        .ok_or_else(|| ModelError::Input("bench document: results is not an array".into()))?;
    let env = doc
        .get("machine")
        .and_then(|m| m.get("command"))
        .and_then(Value::as_str)
        .map(env_of_command)
        .unwrap_or_default();
    let mut points = Vec::new();
    for r in results {
        let path = as_str(r, "transport", "bench row")?.to_owned();
        let size_bytes = as_u64(r, "size_bytes", "bench row")?;
        let (metric, key) = match as_str(r, "kind", "bench row")? {
            "latency" => (Metric::Latency, "p50_ns"),
            "bandwidth" => (Metric::Bandwidth, "gbytes_per_s"),
            other => return Err(ModelError::Input(format!("bench row: unknown kind {other:?}"))),
        };
        match r.get(key).and_then(Value::as_f64) {
            Some(value) if value.is_finite() && value > 0.0 => {
                points.push(Point { path, metric, size_bytes, value })
            }
            _ => {} // skipped or failed cell
        }
    }
    Ok(BenchData { env, points })
}

/// One run of `strait anatomy`: a transport at one size, stage by stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnatomyRun {
    /// Transport name.
    pub path: String,
    /// Message size, bytes.
    pub size_bytes: u64,
    /// One-way latency measured with the probes off, ns.
    pub measured_one_way_ns: f64,
    /// `(stage name, ns)` of the critical-path stages, in path order.
    pub stages: Vec<(String, f64)>,
}

/// Reads a `strait anatomy --format json` document (critical-path stages only).
pub fn parse_anatomy(text: &str) -> Result<Vec<AnatomyRun>, ModelError> {
    let doc: Value = serde_json::from_str(text).map_err(|e| ModelError::Input(format!("not JSON: {e}")))?;
    let runs = field(&doc, "runs", "anatomy document")?
        .as_array()
        .ok_or_else(|| ModelError::Input("anatomy document: runs is not an array".into()))?;
    let mut out = Vec::new();
    for r in runs {
        let path = as_str(r, "transport", "anatomy run")?.to_owned();
        let size_bytes = as_u64(r, "size_bytes", "anatomy run")?;
        let measured_one_way_ns = field(r, "measured_one_way_ns", "anatomy run")?
            .as_f64()
            .ok_or_else(|| ModelError::Input("anatomy run: measured_one_way_ns is not a number".into()))?;
        let mut stages = Vec::new();
        for s in field(r, "stages", "anatomy run")?
            .as_array()
            .ok_or_else(|| ModelError::Input("anatomy run: stages is not an array".into()))?
        {
            if s.get("on_critical_path").and_then(Value::as_bool) == Some(false) {
                continue;
            }
            let name = as_str(s, "name", "anatomy stage")?.to_owned();
            let ns = field(s, "ns", "anatomy stage")?
                .as_f64()
                .ok_or_else(|| ModelError::Input(format!("anatomy stage {name:?}: ns is not a number")))?;
            stages.push((name, ns.max(0.0)));
        }
        out.push(AnatomyRun { path, size_bytes, measured_one_way_ns, stages });
    }
    if out.is_empty() {
        return Err(ModelError::Input("anatomy document has no runs".into()));
    }
    Ok(out)
}

/// Median of several rounds' points: one point per (path, metric, size), the
/// median of its values (the mean of the two middle ones for an even count).
pub fn median_points(rounds: &[Vec<Point>]) -> Vec<Point> {
    let mut all: Vec<&Point> = rounds.iter().flatten().collect();
    all.sort_by(|a, b| {
        (&a.path, a.metric, a.size_bytes)
            .cmp(&(&b.path, b.metric, b.size_bytes))
            .then(a.value.total_cmp(&b.value))
    });
    let mut out = Vec::new();
    let mut i = 0;
    while i < all.len() {
        let key = (&all[i].path, all[i].metric, all[i].size_bytes);
        let j = all[i..]
            .iter()
            .position(|p| (&p.path, p.metric, p.size_bytes) != key)
            .map_or(all.len(), |n| i + n);
        let vals: Vec<f64> = all[i..j].iter().map(|p| p.value).collect();
        let n = vals.len();
        let med = if n % 2 == 1 { vals[n / 2] } else { (vals[n / 2 - 1] + vals[n / 2]) / 2.0 };
        out.push(Point {
            path: all[i].path.clone(),
            metric: all[i].metric,
            size_bytes: all[i].size_bytes,
            value: med,
        });
        i = j;
    }
    out
}

/// A round whose typical time exceeds the best time seen at the same size (any round)
/// by more than this share counts as disturbed (see [`disturbed_rounds`]).
pub const DISTURBED_DEVIATION: f64 = 0.25;

/// How much slower one round is than the best of all rounds: the median over its
/// points of `time / best_time - 1` (0 for the round that was fastest everywhere).
pub fn round_slowdown(round: &[Point], best: &[Point]) -> f64 {
    let mut d: Vec<f64> = round
        .iter()
        .filter_map(|p| {
            best.iter()
                .find(|b| b.path == p.path && b.metric == p.metric && b.size_bytes == p.size_bytes)
                .map(|b| p.time_ns() / b.time_ns() - 1.0)
        })
        .collect();
    d.sort_by(f64::total_cmp);
    if d.is_empty() {
        0.0
    } else {
        d[d.len() / 2]
    }
}

/// The fastest point of several rounds at each (path, metric, size).
fn best_points(rounds: &[Vec<Point>]) -> Vec<Point> {
    let mut best: Vec<Point> = Vec::new();
    for p in rounds.iter().flatten() {
        match best
            .iter_mut()
            .find(|b| b.path == p.path && b.metric == p.metric && b.size_bytes == p.size_bytes)
        {
            Some(b) if p.time_ns() < b.time_ns() => *b = p.clone(),
            Some(_) => {}
            None => best.push(p.clone()),
        }
    }
    best
}

/// Which rounds (of one configuration) were disturbed: a round is disturbed if its
/// [`round_slowdown`] against the best of all rounds exceeds [`DISTURBED_DEVIATION`].
///
/// The reference is the best, not the median, because this machine is bimodal: the
/// host moves the vCPUs, and a whole benchmark process can run 2-3x slower than the
/// next one (or share one vCPU with its peer and wait for time slices). When such
/// runs are the majority, a median reference would call the undisturbed runs the
/// odd ones out.
pub fn disturbed_rounds(rounds: &[Vec<Point>]) -> Vec<bool> {
    let best = best_points(rounds);
    rounds.iter().map(|r| round_slowdown(r, &best) > DISTURBED_DEVIATION).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BENCH: &str = r#"{"machine": {"command": "STRAIT_PIPELINE_THRESHOLD=1024M STRAIT_X='a b' ./strait bench --rounds 1"},
      "results": [
        {"transport": "strait-shm", "kind": "latency", "size_bytes": 4096, "p50_ns": 600.0, "gbytes_per_s": null},
        {"transport": "strait-shm", "kind": "bandwidth", "size_bytes": 4096, "p50_ns": 400.0, "gbytes_per_s": 10.24},
        {"transport": "kernel-udp", "kind": "latency", "size_bytes": 1048576, "p50_ns": null, "gbytes_per_s": null, "note": "skipped"}
      ]}"#;

    #[test]
    fn reads_bench_json() {
        let d = parse_bench(BENCH).unwrap();
        assert_eq!(d.points.len(), 2);
        assert_eq!(d.points[0].metric, Metric::Latency);
        assert_eq!(d.points[0].value, 600.0);
        assert_eq!(d.points[1].metric, Metric::Bandwidth);
        assert!((d.points[1].time_ns() - 400.0).abs() < 1e-9);
        assert_eq!(d.env("STRAIT_PIPELINE_THRESHOLD"), Some("1024M"));
        assert_eq!(d.env("STRAIT_X"), Some("a"), "a quoted value with a space is cut at the space");
    }

    #[test]
    fn reads_anatomy_json() {
        let a = r#"{"runs": [{"transport": "strait-shm", "size_bytes": 8, "measured_one_way_ns": 212.0,
            "stages": [{"name": "a", "ns": 10.0, "on_critical_path": true},
                       {"name": "doorbell", "ns": 5.0, "on_critical_path": false},
                       {"name": "b", "ns": -1.0}]}]}"#;
        let r = parse_anatomy(a).unwrap();
        assert_eq!(r[0].stages, vec![("a".to_owned(), 10.0), ("b".to_owned(), 0.0)]);
    }

    #[test]
    fn bad_documents_are_errors() {
        assert!(parse_bench("not json").is_err());
        assert!(parse_bench("{}").is_err());
        assert!(
            parse_bench(r#"{"results": [{"transport": "x", "kind": "sideways", "size_bytes": 1}]}"#).is_err()
        );
        assert!(
            parse_bench(r#"{"results": [{"transport": "x", "kind": "latency", "size_bytes": -1}]}"#).is_err()
        );
        assert!(parse_anatomy(r#"{"runs": []}"#).is_err());
        assert!(parse_anatomy(r#"{"runs": [{"transport": "x"}]}"#).is_err());
    }

    #[test]
    fn medians_over_rounds() {
        let p = |v: f64| Point { path: "p".into(), metric: Metric::Latency, size_bytes: 8, value: v };
        let m = median_points(&[vec![p(3.0)], vec![p(1.0)], vec![p(100.0)]]);
        assert_eq!(m, vec![p(3.0)]);
        let m = median_points(&[vec![p(3.0)], vec![p(1.0)]]);
        assert_eq!(m, vec![p(2.0)]);
    }

    #[test]
    fn a_disturbed_round_is_found() {
        let round = |k: f64| -> Vec<Point> {
            (0..6)
                .map(|i| Point {
                    path: "p".into(),
                    metric: Metric::Latency,
                    size_bytes: 1 << i,
                    value: 100.0 * k,
                })
                .collect()
        };
        let d = disturbed_rounds(&[round(1.0), round(1.02), round(0.99), round(3.0), round(1.01)]);
        assert_eq!(d, vec![false, false, false, true, false]);
        // Uniform small noise: nothing disturbed.
        assert!(!disturbed_rounds(&[round(1.0), round(1.05), round(0.95)]).contains(&true));
        // A machine slow in most rounds: the fast minority is the undisturbed one.
        let d = disturbed_rounds(&[round(2.5), round(1.0), round(2.4), round(1.03), round(2.6)]);
        assert_eq!(d, vec![true, false, true, false, true]);
    }

    #[test]
    fn env_words_stop_at_the_command() {
        let e = env_of_command("STRAIT_A=1 strait bench STRAIT_B=2");
        assert_eq!(e, vec![("STRAIT_A".to_owned(), "1".to_owned())]);
    }
}
