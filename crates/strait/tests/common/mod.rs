//! Helpers shared by the real-program tests: the preload library build, `strait run`
//! commands, package installs and bounded runs.
// Each test binary uses its own subset.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};

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

pub use strait_testkit::{ensure, run_for};

pub fn plain(prog: &str) -> Command {
    let mut c = Command::new(prog);
    c.env_remove("LD_PRELOAD");
    c
}

/// Starts `cmd` with its stdout and stderr piped and waits for its first line,
/// which must be `want`; returns the child and the reader of the rest of its stdout.
pub fn spawn_until_line(cmd: &mut Command, want: &str) -> (Child, BufReader<ChildStdout>) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let mut r = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    r.read_line(&mut line).expect(want);
    assert_eq!(line.trim(), want, "{cmd:?}");
    (child, r)
}
