//! `strait model`: the must-hold check on a real run of this machine (the
//! model fitted on one set of sizes predicts strait's shm latency and bandwidth at
//! 4 KiB .. 4 MiB within a median 10%), and fit / predict / error handling on files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strait-model-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create temp dir");
    d
}

/// Benchmark runs spin both cores: they take turns, within this test binary (the
/// mutex) and with other processes running this test (the file lock).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Turn {
    _guard: std::sync::MutexGuard<'static, ()>,
    _file: std::fs::File,
}

fn turn() -> Turn {
    use std::os::fd::AsRawFd;
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let path = std::env::temp_dir().join("strait-benchmark.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .expect("open lock file");
    // SAFETY: flock on a descriptor we own; released when the file is closed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock {}", path.display());
    Turn { _guard: guard, _file: file }
}

fn strait(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strait")).args(args).output().expect("run strait")
}

fn json_stdout(o: &Output) -> Value {
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "strait failed: {stderr}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("stdout is not one JSON document: {e}\n{stdout}"))
}

fn median_of(doc: &Value, path: &str, metric: &str) -> f64 {
    doc["medians"]
        .as_array()
        .and_then(|m| m.iter().find(|x| x["path"] == path && x["metric"] == metric))
        .and_then(|x| x["median_rel_error"].as_f64())
        .unwrap_or_else(|| panic!("no median for {path} {metric}: {}", doc["medians"]))
}

/// The largest RMS residual of the shm fit (large only when the run was noisy).
fn worst_fit_residual(doc: &Value) -> f64 {
    let shm = &doc["model"]["shm"];
    let mut v =
        vec![shm["eager"]["rms_rel"].as_f64().unwrap_or(0.0), shm["rndv"]["rms_rel"].as_f64().unwrap_or(0.0)];
    for b in shm["bandwidth"].as_array().into_iter().flatten() {
        for k in ["eager", "rndv"] {
            v.push(b[1][k]["rms_rel"].as_f64().unwrap_or(0.0));
        }
    }
    v.into_iter().fold(0.0, f64::max)
}

/// `strait model check` on a real run of this machine (the shm path, fitted on
/// 3·2^k sizes, checked at 2^k): the document's schema, fit and check sizes apart,
/// every case's relative error and every median computed from the cases as
/// documented. How close the predictions come on this host (the 10% target) is a
/// benchmark, `scripts/bench-targets`, not a test.
#[test]
fn model_check_document_is_consistent() {
    let _turn = turn();
    let out = tmp_dir("check");
    let o = strait(&[
        "model",
        "check",
        "--format",
        "json",
        "--paths",
        "strait-shm",
        "--rounds",
        "3",
        "--out",
        out.to_str().expect("utf-8 temp dir"),
    ]);
    let doc = json_stdout(&o);
    let cases = doc["cases"].as_array().expect("cases");
    assert!(!cases.is_empty(), "no cases: {doc}");
    for c in cases {
        for k in ["path", "metric", "size_bytes", "predicted", "measured", "rel_error"] {
            assert!(c.get(k).is_some(), "case lacks {k}: {c}");
        }
        assert_eq!(c["path"], "strait-shm");
        let s = c["size_bytes"].as_u64().expect("size");
        assert!((4096..=4 << 20).contains(&s), "{c}");
        let (p, m) = (c["predicted"].as_f64().expect("predicted"), c["measured"].as_f64().expect("measured"));
        assert!(p > 0.0 && m > 0.0, "{c}");
        let e = c["rel_error"].as_f64().expect("rel_error");
        assert!(
            (e - ((p - m) / m).abs()).abs() < 1e-6,
            "rel_error is |predicted - measured| / measured: {c}"
        );
    }
    let fit: Vec<u64> =
        doc["fit_sizes"].as_array().expect("fit_sizes").iter().filter_map(Value::as_u64).collect();
    assert!(!fit.is_empty());
    assert!(
        cases.iter().all(|c| !fit.contains(&c["size_bytes"].as_u64().unwrap_or(0))),
        "checked at a fit size"
    );
    // Each (path, metric) median is the median of its cases' errors.
    for metric in ["latency", "bandwidth"] {
        let mut errs: Vec<f64> =
            cases.iter().filter(|c| c["metric"] == metric).filter_map(|c| c["rel_error"].as_f64()).collect();
        if errs.is_empty() {
            continue;
        }
        errs.sort_by(f64::total_cmp);
        let n = errs.len();
        let med = if n % 2 == 1 { errs[n / 2] } else { (errs[n / 2 - 1] + errs[n / 2]) / 2.0 };
        let got = median_of(&doc, "strait-shm", metric);
        assert!((got - med).abs() < 1e-6, "{metric}: median {got} vs cases {med}");
    }
    assert!(doc["median_rel_error"].as_f64().is_some());
    assert!(worst_fit_residual(&doc).is_finite());
    let _ = std::fs::remove_dir_all(&out);
}

fn bench_doc(command: &str, rows: &[(&str, &str, u64, f64)]) -> String {
    let results: Vec<Value> = rows
        .iter()
        .map(|&(t, kind, size, v)| {
            let (p50, gbps) = if kind == "latency" { (v, None) } else { (size as f64 / v, Some(v)) };
            serde_json::json!({"transport": t, "kind": kind, "size_bytes": size, "p50_ns": p50, "gbytes_per_s": gbps})
        })
        .collect();
    serde_json::json!({"machine": {"command": command}, "results": results}).to_string()
}

/// A synthetic shm path: eager 300 ns + 0.06 ns/B; rendezvous a 1.5 us handshake
/// and two pipelined copies; bandwidth 150 ns + 0.06 ns/B per message.
fn synthetic_bench(dir: &Path) -> PathBuf {
    let mut rows = Vec::new();
    for e in 10..=22 {
        for b in [1u64 << e, 3 << e] {
            let lat = if b <= 32768 { 300.0 + 0.06 * b as f64 } else { 1500.0 + 0.1 * b as f64 };
            rows.push(("strait-shm", "latency", b, lat));
            rows.push(("strait-shm", "bandwidth", b, b as f64 / (150.0 + 0.06 * b as f64)));
            rows.push(("pipe", "latency", b, 7000.0 + 0.3 * b as f64));
        }
    }
    let p = dir.join("bench.json");
    std::fs::write(&p, bench_doc("./strait bench", &rows)).expect("write");
    p
}

#[test]
fn model_fit_and_predict_from_files() {
    // Not a benchmark, but its processes would disturb one that runs meanwhile.
    let _turn = turn();
    let dir = tmp_dir("files");
    let bench = synthetic_bench(&dir);
    let model = dir.join("model.json");
    let doc = json_stdout(&strait(&[
        "model",
        "fit",
        bench.to_str().unwrap_or_default(),
        "--format",
        "json",
        "--save",
        model.to_str().unwrap_or_default(),
    ]));
    let eager = &doc["model"]["shm"]["eager"];
    assert!((eager["per_packet_ns"].as_f64().unwrap_or(0.0) - 300.0).abs() < 1.0, "{eager}");
    assert!((eager["per_byte_ns"].as_f64().unwrap_or(0.0) - 0.06).abs() < 1e-6, "{eager}");
    assert!(eager["residuals"].as_array().is_some_and(|r| !r.is_empty()), "residuals reported");
    assert!(doc["model"]["lumped"].as_array().is_some_and(|l| l.len() == 1), "pipe fitted end to end");

    // An anatomy document: every stage a layer.
    let anatomy = dir.join("anatomy.json");
    let runs: Vec<Value> = [4096u64, 16384, 32768]
        .iter()
        .map(|&b| {
            serde_json::json!({"transport": "strait-shm", "size_bytes": b, "measured_one_way_ns": 100.0 + 0.07 * b as f64,
                "stages": [{"name": "post", "ns": 100.0, "on_critical_path": true},
                           {"name": "copy", "ns": 0.07 * b as f64, "on_critical_path": true}]})
        })
        .collect();
    std::fs::write(&anatomy, serde_json::json!({ "runs": runs }).to_string()).expect("write");
    let doc =
        json_stdout(&strait(&["model", "fit", anatomy.to_str().unwrap_or_default(), "--format", "json"]));
    let layers = &doc["layers"][0]["layers"];
    assert_eq!(layers[1]["name"], "copy");
    assert!((layers[1]["fit"]["per_byte_ns"].as_f64().unwrap_or(0.0) - 0.07).abs() < 1e-9, "{layers}");

    // What-if: coarse pipelining and a copy engine twice as fast, plus a direct path.
    let toml = dir.join("machine.toml");
    std::fs::write(
        &toml,
        "sizes = [\"4K\", \"1M\"]\nmodel = \"model.json\"\n[shm]\npipeline_threshold = \"1G\"\ncopy_speedup = 2.0\n\
         [[path]]\nname = \"link\"\npipelining = \"fine\"\nthreshold = \"4K\"\n\
         layers = [{ name = \"host\", per_packet_ns = 1000.0 }, { name = \"wire\", per_byte_ns = 0.1 }]\n",
    )
    .expect("write");
    let out = dir.join("out");
    let doc = json_stdout(&strait(&[
        "model",
        "predict",
        toml.to_str().unwrap_or_default(),
        "--format",
        "json",
        "--measured",
        bench.to_str().unwrap_or_default(),
        "--out",
        out.to_str().unwrap_or_default(),
    ]));
    let p = doc["predictions"].as_array().expect("predictions");
    assert_eq!(p.len(), 3 * 2, "fitted, what-if and the direct path at two sizes: {doc}");
    let at = |scenario: &str, size: u64| {
        p.iter()
            .find(|r| {
                r["scenario"].as_str().is_some_and(|s| s.starts_with(scenario)) && r["size_bytes"] == size
            })
            .and_then(|r| r["latency_ns"].as_f64())
            .unwrap_or_else(|| panic!("{scenario} {size}: {doc}"))
    };
    assert!(at("strait-shm what-if", 4096) < at("strait-shm fitted", 4096), "a faster copy is faster");
    assert!((at("link", 1 << 20) - (1000.0 + 0.1 * (1u64 << 20) as f64)).abs() < 1e-6);
    let svg = std::fs::read_dir(&out)
        .expect("out dir")
        .flatten()
        .next()
        .expect("result dir")
        .path()
        .join("predict.svg");
    assert!(std::fs::read_to_string(svg).is_ok_and(|s| s.contains("<polyline") && s.contains("<circle")));
}

#[test]
fn model_errors_are_reported() {
    let _turn = turn();
    let dir = tmp_dir("errors");
    let junk = dir.join("junk.json");
    std::fs::write(&junk, "{\"neither\": 1}").expect("write");
    let bad_toml = dir.join("bad.toml");
    std::fs::write(
        &bad_toml,
        "[[path]]\nname = \"x\"\npipelining = \"medium\"\nlayers = [{ name = \"a\" }]\n",
    )
    .expect("write");
    let d = dir.to_str().unwrap_or_default();
    for (args, want) in [
        (vec!["model", "fit", junk.to_str().unwrap_or_default()], "neither"),
        (vec!["model", "fit", "/nonexistent/x.json"], "/nonexistent/x.json"),
        (vec!["model", "predict", bad_toml.to_str().unwrap_or_default()], "medium"),
        (
            vec![
                "model",
                "check",
                "--fit-sizes",
                "4K,8K",
                "--check-sizes",
                "8K",
                "--from",
                junk.to_str().unwrap_or_default(),
                "--out",
                d,
            ],
            "",
        ),
        (vec!["model", "check", "--paths", "carrier-pigeon", "--out", d], "carrier-pigeon"),
        (vec!["model", "check", "--modes", "medium", "--out", d], "medium"),
    ] {
        let o = strait(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}
