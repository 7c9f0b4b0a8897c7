//! Helpers shared by the real-program tests: the preload library build, `strait run`
//! commands, package installs and bounded runs.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const STRAIT: &str = env!("CARGO_BIN_EXE_strait");

/// libstrait_preload.so next to the strait binary, built on first use.
pub fn preload_lib() -> PathBuf {
    strait_testkit::preload_lib_beside(STRAIT)
}

pub fn strait_run(args: &[&str]) -> Command {
    preload_lib();
    let mut c = Command::new(STRAIT);
    c.arg("run").args(args).env_remove("LD_PRELOAD");
    c
}

pub fn have(bin: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs a command with a time limit (killed when it expires), reading its output
/// while it runs.
pub fn run_for(c: &mut Command, limit: Duration) -> Option<Output> {
    use std::io::Read;
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().ok()?;
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as Box<dyn Read + Send>));
    let end = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().ok()? {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Some(Output { status, stdout: out.join().ok()?, stderr: err.join().ok()? })
}

/// Asserts that `bin` (from Debian's package `pkg`) is installed. Tests never install
/// anything: `scripts/install-deps`, which the test command runs first, does it once
/// (two tests installing at once fought over the dpkg lock).
pub fn ensure(bin: &str, pkg: &str) {
    assert!(have(bin), "{bin} is missing: run scripts/install-deps (it installs {pkg}) before the tests");
}

pub fn plain(prog: &str) -> Command {
    let mut c = Command::new(prog);
    c.env_remove("LD_PRELOAD");
    c
}
