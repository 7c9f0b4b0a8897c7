//! Helpers shared by the preload's process tests: the library build, peer commands
//! with or without the library, and bounded waits that collect output.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The preload library next to the peer binary. `cargo test` does not build a
/// cdylib, so the first call builds it with the same cargo, profile and target dir.
pub fn lib(peer: &str) -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let peer = PathBuf::from(peer);
            let profile_dir = peer.parent().expect("profile dir");
            let profile = profile_dir.file_name().and_then(|s| s.to_str()).expect("profile name").to_string();
            let target_dir = profile_dir.parent().expect("target dir");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut c = Command::new(cargo);
            c.args(["build", "--offline", "-q", "-p", "strait-preload", "--lib", "--target-dir"])
                .arg(target_dir);
            match profile.as_str() {
                "debug" => {}
                "release" => {
                    c.arg("--release");
                }
                p => {
                    c.args(["--profile", p]);
                }
            }
            let st = c.status().expect("run cargo build for libstrait_preload.so");
            assert!(st.success(), "building libstrait_preload.so failed");
            let p = profile_dir.join("libstrait_preload.so");
            assert!(p.exists(), "{} missing after the build", p.display());
            p
        })
        .clone()
}

pub fn cmd(peer: &str, preload: bool, args: &[&str]) -> Command {
    let mut c = Command::new(peer);
    c.args(args).env("STRAIT_STATS", "1").env_remove("LD_PRELOAD");
    if preload {
        c.env("LD_PRELOAD", lib(peer));
    }
    c
}

pub struct Out {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Waits for `child` (killing it at `deadline`), collecting the rest of its output.
pub fn finish(mut child: Child, lines: mpsc::Receiver<String>, mut first: String, deadline: Instant) -> Out {
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    while let Ok(l) = lines.recv_timeout(Duration::from_secs(2)) {
        first.push_str(&l);
    }
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    Out { ok: status.is_some_and(|s| s.success()), stdout: first, stderr }
}

pub fn spawn_lines(c: &mut Command) -> (Child, mpsc::Receiver<String>) {
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn peer");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l + "\n").is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Fails the test with both outputs unless the process succeeded.
pub fn check(o: &Out, what: &str) {
    assert!(o.ok, "{what} failed:\nstdout:\n{}\nstderr:\n{}", o.stdout, o.stderr);
}

/// Sum of counter `name` over the `strait-preload: pid ...` statistics lines.
pub fn stat_sum(o: &Out, name: &str) -> usize {
    stat(&o.stderr, name)
}

/// Sum of counter `name` over the statistics lines in `stderr`.
pub fn stat(stderr: &str, name: &str) -> usize {
    let key = format!(" {name} ");
    stderr
        .lines()
        .filter(|l| l.starts_with("strait-preload: pid "))
        .filter_map(|l| l.split(key.as_str()).nth(1)?.split_whitespace().next()?.parse::<usize>().ok())
        .sum()
}
