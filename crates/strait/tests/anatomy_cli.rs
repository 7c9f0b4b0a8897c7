//! Runs the built `strait anatomy --format json` (built by `cargo test` with the
//! stage probes compiled in, see the dev-dependencies in Cargo.toml) on two sizes
//! with few iterations, and checks the document: its schema, that every stage was
//! observed, that the stages add up to the reported sum, and that the reported
//! agreement with the one-way latency measured with the probes off is computed
//! right. Whether the sum lands within the tolerance on this host is a benchmark
//! target, not a test (scripts/bench-targets): a burst of other work or a bimodal
//! kernel path can move one short run, and a test proves correctness.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use strait_testkit::root_or_skip;

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("strait-anatomy-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Each run spins both cores: two at once would distort each other's stages.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn num(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or_else(|| panic!("{k} missing or not a number in {v}"))
}

fn text<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or_else(|| panic!("{k} missing or not a string in {v}"))
}

/// Runs `strait anatomy --format json` with `args` and `--out out`; fails the test
/// unless it succeeds, and returns the JSON document it printed and its stderr.
fn anatomy_json<S: AsRef<OsStr>>(args: &[S], out: &Path) -> (Value, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_strait"))
        .args(["anatomy", "--format", "json"])
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("run strait");
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "strait anatomy failed ({:?}): {stderr}", o.status.code());
    let stdout = String::from_utf8(o.stdout).expect("utf-8 stdout");
    (serde_json::from_str(&stdout).expect("stdout is one JSON document"), stderr)
}

/// The run's deviation and its within-tolerance verdict are computed right from its
/// stage sum and measurement (whether this host lands within is a benchmark target).
fn check_verdict(r: &Value, sum: f64, measured: f64, tol: f64, floor: f64) {
    let dev = (sum - measured) / measured;
    assert!((num(r, "deviation") - dev).abs() < 1e-9, "{r}");
    let agrees = dev.abs() <= tol || (sum - measured).abs() <= floor;
    assert_eq!(r["within_tolerance"].as_bool(), Some(agrees), "{r}");
}

/// One run's JSON document, with every schema and consistency check.
fn run_and_check(out: &PathBuf) -> Value {
    let _ = std::fs::remove_dir_all(out);
    let (doc, stderr) = anatomy_json(
        &["--sizes", "8,4K", "--iters", "1000", "--warmup", "200", "--transports", "strait-shm"],
        out,
    );

    let machine = doc.get("machine").expect("machine");
    assert!(text(machine, "command").contains("anatomy"));
    let probe_ns = num(&doc, "probe_cost_ns");
    assert!((0.0..1000.0).contains(&probe_ns), "probe cost {probe_ns} ns");
    assert!(num(&doc, "probe_cost_back_to_back_ns") > 0.0);
    let tol = num(&doc, "tolerance");
    let floor = num(&doc, "tolerance_floor_ns");
    assert!(floor > 0.0 && floor <= 20.0, "absolute floor {floor} ns");
    assert!((tol - 0.10).abs() < 1e-9);
    assert!(doc.get("notes").and_then(Value::as_array).is_some());

    let runs = doc.get("runs").and_then(Value::as_array).expect("runs");
    let sizes: Vec<u64> = runs.iter().map(|r| r["size_bytes"].as_u64().expect("size_bytes")).collect();
    assert_eq!(sizes, vec![8, 4096]);
    for r in runs {
        assert_eq!(text(r, "transport"), "strait-shm");
        assert!(r.get("wake_modes").is_none(), "strait's paths have no wake-up modes: {r}");
        let measured = num(r, "measured_one_way_ns");
        let sum = num(r, "stage_sum_ns");
        assert!(measured > 0.0 && num(r, "total_p50_ns") > 0.0 && num(r, "probe_overhead_ns") >= 0.0);
        assert!(num(r, "probe_cost_ns") >= 0.0 && num(r, "probe_cost_doubled_ns") >= 0.0);
        assert!(num(r, "deviation_doubled").is_finite());
        // (Equal when the probe cost came out 0: then the two sums differ only by
        // floating-point rounding.)
        assert!(
            num(r, "probed_one_way_ns") >= sum * (1.0 - 1e-9),
            "raw probed time below the corrected sum: {r}"
        );
        assert!(r["samples"].as_u64().unwrap_or(0) >= 500, "too few paths analysed: {r}");
        let stages = r.get("stages").and_then(Value::as_array).expect("stages");
        assert!(stages.len() >= 8, "expected the eager chain's stages: {r}");
        let mut critical = 0.0;
        for s in stages {
            let name = text(s, "name");
            assert!(!text(s, "layer").is_empty());
            // A stage shorter than the probe-cost calibration's error reads 0 after
            // the subtraction; never negative.
            let ns = num(s, "ns");
            assert!(ns >= 0.0, "stage {name} of size {} took {ns} ns", r["size_bytes"]);
            assert!(num(s, "p50_ns") >= 0.0 && num(s, "p99_ns") >= num(s, "p50_ns"));
            assert!(num(s, "cycles") >= 0.0);
            if s["on_critical_path"].as_bool().expect("on_critical_path") {
                critical += ns;
            }
        }
        assert!((critical - sum).abs() < 1e-6 * sum.max(1.0), "stages add to {critical}, sum says {sum}");
        check_verdict(r, sum, measured, tol, floor);
        assert!(sum > 0.0, "the stages took no time at all: {r}");
    }

    // The report files are where stderr says.
    let dirs: Vec<PathBuf> = std::fs::read_dir(out).expect("out dir").flatten().map(|e| e.path()).collect();
    assert_eq!(dirs.len(), 1, "one anatomy-<stamp> directory: {dirs:?}");
    assert!(dirs[0].file_name().is_some_and(|n| n.to_string_lossy().starts_with("anatomy-")));
    let json = std::fs::read_to_string(dirs[0].join("anatomy.json")).expect("anatomy.json");
    assert_eq!(serde_json::from_str::<Value>(&json).expect("file is JSON"), doc);
    let svg = std::fs::read_to_string(dirs[0].join("anatomy.svg")).expect("anatomy.svg");
    assert!(svg.starts_with("<svg") && svg.contains("<rect"));
    assert!(stderr.contains("anatomy.json"));
    doc
}

#[test]
fn anatomy_json_schema_and_stage_sums() {
    let _turn = turn();
    let out = tmp_dir("json");
    run_and_check(&out);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn anatomy_table_prints_the_check() {
    let _turn = turn();
    let out = tmp_dir("table");
    let o = Command::new(env!("CARGO_BIN_EXE_strait"))
        .args(["anatomy", "--sizes", "64", "--iters", "100", "--warmup", "50", "--rounds", "2"])
        .args(["--transports", "strait-shm"])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run strait");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let t = String::from_utf8_lossy(&o.stdout);
    for needle in ["probe cost", "ring transfer + peer poll", "= sum of stages", "measured one-way", "check:"]
    {
        assert!(t.contains(needle), "table lacks {needle:?}:\n{t}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The kernel UDP and TCP paths, traced through tracepoints (root only): every
/// stage of the chain sees time, and the sum agrees with the untraced latency. The
/// kernel's wake-up dominates and varies between batches on this 2-core machine, so,
/// as for strait's own paths, up to three runs are made; every run must pass the
/// schema checks.
#[test]
fn kernel_udp_and_tcp_anatomy_as_root() {
    if !root_or_skip("the kernel paths need root (tracefs)") {
        return;
    }
    let _turn = turn();
    let out = tmp_dir("kudp");
    let (doc, _) = anatomy_json(
        &["--transports", "kernel-udp,kernel-tcp", "--sizes", "8", "--iters", "400", "--warmup", "50"],
        &out,
    );
    let runs = doc["runs"].as_array().expect("runs");
    let names: Vec<&str> = runs.iter().map(|r| text(r, "transport")).collect();
    assert_eq!(names, vec!["kernel-udp", "kernel-tcp"], "{doc}");
    for r in runs {
        let stages = r["stages"].as_array().expect("stages");
        let want = if text(r, "transport") == "kernel-tcp" { 13 } else { 11 };
        assert_eq!(stages.len(), want, "{r}");
        assert!(r["samples"].as_u64().unwrap_or(0) > 0, "no traced path was walked: {r}");
        for s in stages {
            let name = text(s, "name");
            // Every stage's bounding events were seen in order. The wake-up stage is
            // zero when the receiver was still running; the application turnaround
            // is two back-to-back user stamps. After the per-event tracing cost is
            // subtracted a short stage may read 0 (on an Intel host the loopback
            // device transmit is shorter than the calibration's error), never less.
            let raw = num(s, "raw_ns");
            if !name.starts_with("wake-up") {
                assert!(raw > 0.0, "kernel stage {name} was not observed: {r}");
            }
            assert!(num(s, "ns") >= 0.0 && num(s, "ns") <= raw + 1e-9, "{name}: {r}");
        }
        assert!(r["probe_cost_doubled_ns"].is_null());
        // The wake-up modes: the share of traced paths whose receiver was woken, and,
        // when the modes were compared apart, one entry per mode whose untraced
        // shares (the weights of the comparison) add up to 1.
        let modes = r.get("wake_modes").expect("wake_modes on a kernel path");
        assert!((0.0..=1.0).contains(&num(modes, "woken_traced")), "{r}");
        if modes["mode_aware"].as_bool().expect("mode_aware") {
            let list = modes["modes"].as_array().expect("modes");
            assert!(list.len() >= 2, "{r}");
            let shares: f64 = list.iter().map(|m| num(m, "plain_share")).sum();
            assert!((shares - 1.0).abs() < 1e-9, "{r}");
            assert!((0.0..=1.0).contains(&num(modes, "woken_plain")), "{r}");
        }
        let dev = num(r, "deviation");
        let sum = num(r, "stage_sum_ns");
        let measured = num(r, "measured_one_way_ns");
        assert!(sum > 0.0 && measured > 0.0, "{r}");
        assert!((dev - (sum - measured) / measured).abs() < 1e-9, "{r}");
        assert_eq!(
            r["within_tolerance"].as_bool(),
            Some(
                dev.abs() <= num(&doc, "tolerance")
                    || (sum - measured).abs() <= num(&doc, "tolerance_floor_ns")
            )
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// Without privileges (run as `nobody` with no capabilities): the kernel paths are
/// refused with a clear message, strait's own breakdown is still printed, and the
/// exit status is 3.
#[test]
fn unprivileged_run_reports_and_exits_3() {
    if !root_or_skip("dropping to nobody needs root to start from") {
        return;
    }
    let exe = env!("CARGO_BIN_EXE_strait");
    let probe = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", exe, "--version"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("skipped: setpriv missing, or {exe} is not executable by nobody");
        return;
    }
    let _turn = turn();
    let out = tmp_dir("nobody");
    std::fs::create_dir_all(&out).expect("out dir");
    let mut perm = std::fs::metadata(&out).expect("out dir").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o777);
    std::fs::set_permissions(&out, perm).expect("chmod");
    let o = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", exe])
        .args(["anatomy", "--sizes", "64", "--iters", "200", "--transports", "strait-shm,kernel-udp"])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run strait");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stderr.contains("kernel-udp") && stderr.contains("permission"), "{stderr}");
    assert!(stdout.contains("ring transfer + peer poll"), "strait's own breakdown missing: {stdout}");
    assert!(stdout.contains("kernel-udp: not measured"), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}

/// The path users run: a ping-pong of plain `write`/`read` calls between two
/// processes under the preload library (built with its probes), dissected into the
/// interposer's stages, over TCP (byte rings) and connected UDP (datagram rings).
#[test]
fn strait_run_anatomy_stages_and_check() {
    // The turn first: the library's build must not run beside another test's
    // measurement (nor this one's beside a build).
    let _turn = turn();
    let lib = strait_testkit::preload_lib_with_probes(env!("CARGO_BIN_EXE_strait"));
    let out = tmp_dir("run");
    let args = ["--sizes", "8,4K,64K", "--iters", "1000", "--warmup", "200"]
        .map(OsStr::new)
        .into_iter()
        .chain([OsStr::new("--transports"), OsStr::new("strait-run,strait-run-udp"), OsStr::new("--preload")])
        .chain([lib.as_os_str()])
        .collect::<Vec<_>>();
    let (doc, _) = anatomy_json(&args, &out);
    assert!(text(&doc["machine"], "command").contains("--preload"), "{doc}");
    let runs = doc["runs"].as_array().expect("runs");
    let which: Vec<(&str, u64)> =
        runs.iter().map(|r| (text(r, "transport"), r["size_bytes"].as_u64().expect("size"))).collect();
    // Datagrams are dissected up to 32K, as the kernel's are.
    assert_eq!(
        which,
        vec![
            ("strait-run", 8),
            ("strait-run", 4096),
            ("strait-run", 65536),
            ("strait-run-udp", 8),
            ("strait-run-udp", 4096)
        ],
        "{doc}"
    );
    let notes = doc["notes"].as_array().expect("notes");
    assert!(
        notes.iter().any(|n| n.as_str().is_some_and(|n| n.contains("strait-run-udp: sizes above 32K"))),
        "{doc}"
    );
    let chain = [
        "interposer entry",
        "descriptor look-up",
        "ring copy in + publish",
        "ring transfer + reader's spin or wake-up",
        "ring copy out + consume",
        "read return (writer wake check)",
        "interposer exit",
        "application turnaround",
    ];
    let tol = num(&doc, "tolerance");
    let floor = num(&doc, "tolerance_floor_ns");
    for r in runs {
        assert!(r["samples"].as_u64().unwrap_or(0) >= 300, "too few paths walked: {r}");
        let stages = r["stages"].as_array().expect("stages");
        let critical: Vec<&Value> = stages.iter().filter(|s| s["on_critical_path"] == true).collect();
        let names: Vec<&str> = critical.iter().map(|s| text(s, "name")).collect();
        assert_eq!(names, chain, "{r}");
        let sum = num(r, "stage_sum_ns");
        let measured = num(r, "measured_one_way_ns");
        let total: f64 = critical.iter().map(|s| num(s, "ns")).sum();
        assert!((total - sum).abs() < 1e-6 * sum.max(1.0), "stages add to {total}, sum says {sum}");
        assert!(critical.iter().all(|s| num(s, "ns") >= 0.0), "{r}");
        // The raw probed time is never below the corrected sum (equal, up to
        // floating-point rounding, when the probe cost came out 0).
        assert!(measured > 0.0 && num(r, "probed_one_way_ns") >= sum * (1.0 - 1e-9), "{r}");
        check_verdict(r, sum, measured, tol, floor);
    }
}

/// A library without its probes is refused with the command that builds one, and
/// the run ends as incomplete (exit 3) instead of reporting empty stages.
#[test]
fn strait_run_anatomy_without_probes_says_how_to_build() {
    let _turn = turn();
    let lib = strait_testkit::preload_lib_beside(env!("CARGO_BIN_EXE_strait"));
    let o = Command::new(env!("CARGO_BIN_EXE_strait"))
        .args(["anatomy", "--format", "json", "--sizes", "8", "--iters", "100", "--warmup", "10"])
        .args(["--transports", "strait-run", "--preload"])
        .arg(&lib)
        .arg("--out")
        .arg(tmp_dir("run-plain"))
        .output()
        .expect("run strait");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("--features probes"), "{stderr}");
}

/// `--across-netns` (root only: namespaces, XDP, tracefs): strait's udp and xdp
/// devices and the kernel's UDP and TCP between two namespaces, eager and
/// rendezvous sizes (a rendezvous failed after 5 s while the answering end did not
/// drive its worker between batches), every stage of each
/// chain observed, the stages adding up to the reported sum, the kernel's device
/// stage named for the veth pair, and the namespaces removed after. Paths that
/// exist only on one host are refused.
#[test]
fn across_netns_anatomy_of_strait_and_kernel_as_root() {
    if !root_or_skip("--across-netns needs root (namespaces, XDP, tracefs)") {
        return;
    }
    let _turn = turn();
    let out = tmp_dir("across");
    let (doc, _) = anatomy_json(
        &["--across-netns", "--sizes", "8,4K,32K", "--iters", "400", "--warmup", "50", "--rounds", "2"],
        &out,
    );
    assert!(text(&doc["machine"], "command").contains("--across-netns"), "{doc}");
    let notes = doc["notes"].as_array().expect("notes");
    assert!(notes.iter().any(|n| n.as_str().is_some_and(|n| n.contains("network namespaces"))), "{doc}");
    let runs = doc["runs"].as_array().expect("runs");
    let cells: Vec<(&str, u64)> =
        runs.iter().map(|r| (text(r, "transport"), r["size_bytes"].as_u64().expect("size"))).collect();
    let mut want = Vec::new();
    for t in ["strait-udp", "strait-xdp", "kernel-udp", "kernel-tcp"] {
        // 4K: a frame of three packets; 32K: a rendezvous (RTS, CTS, data).
        want.extend([(t, 8), (t, 4096), (t, 32768)]);
    }
    assert_eq!(cells, want, "{doc}");
    let (tol, floor) = (num(&doc, "tolerance"), num(&doc, "tolerance_floor_ns"));
    for r in runs {
        let t = text(r, "transport");
        let stages = r["stages"].as_array().expect("stages");
        assert!(r["samples"].as_u64().unwrap_or(0) > 0, "no path was walked: {r}");
        let names: Vec<&str> = stages.iter().map(|s| text(s, "name")).collect();
        let mut critical = 0.0;
        for s in stages {
            let name = text(s, "name");
            let ns = num(s, "ns");
            assert!(ns >= 0.0, "{t} stage {name}: {ns} ns");
            if s["on_critical_path"].as_bool().expect("on_critical_path") {
                critical += ns;
            }
        }
        let (sum, measured) = (num(r, "stage_sum_ns"), num(r, "measured_one_way_ns"));
        assert!(sum > 0.0 && measured > 0.0, "{r}");
        assert!((critical - sum).abs() < 1e-6 * sum.max(1.0), "{t}: stages add to {critical}, sum {sum}");
        check_verdict(r, sum, measured, tol, floor);
        if t.starts_with("strait-") {
            // The wire stage holds the send call, both kernels' (or XDP's) work and the
            // peer's poll: microseconds, never nothing.
            let wire = stages
                .iter()
                .find(|s| text(s, "name") == "send call + kernel/wire + peer's receive poll")
                .unwrap_or_else(|| panic!("{t}: no wire stage in {names:?}"));
            assert!(num(wire, "ns") > 0.0, "{t}: {r}");
            assert!(
                names.contains(&"doorbell (overlaps transfer)"),
                "{t}: the send call beside the chain: {names:?}"
            );
        } else {
            assert!(names.contains(&"device transmit (veth)"), "{t}: {names:?}");
            for s in stages {
                let name = text(s, "name");
                if !name.starts_with("wake-up") {
                    assert!(num(s, "raw_ns") > 0.0, "{t} stage {name} was not observed: {r}");
                }
            }
        }
    }
    let left = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    assert!(!String::from_utf8_lossy(&left.stdout).contains("stan"), "namespaces left behind");

    let o = Command::new(env!("CARGO_BIN_EXE_strait"))
        .args(["anatomy", "--across-netns", "--transports", "strait-shm"])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run strait");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && stderr.contains("strait-shm with --across-netns"), "{stderr}");
    let _ = std::fs::remove_dir_all(&out);
}
