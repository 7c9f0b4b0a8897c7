//! Test support shared by strait's crates (a dev-dependency only, never published):
//! what the process tests of `strait-preload` and `strait` both need, including
//! building the preload library and the test peers of `strait-testpeers` for them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `libstrait_preload.so` beside `exe` (a binary of the test's build, e.g. a peer or
/// `strait`). `cargo test` does not build cdylibs, so the first call in a test binary
/// builds it with the same cargo, profile and target directory as `exe`.
pub fn preload_lib_beside(exe: impl AsRef<Path>) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build_preload(exe.as_ref(), false)).clone()
}

/// `libstrait_preload.so` with its stage probes compiled in (for `strait anatomy
/// --transports strait-run`), built on first use with the cargo and profile of
/// `exe` into the `probes` directory of its target directory: a cdylib's file name
/// does not change with its features, so the plain library beside `exe` is left as
/// it is.
pub fn preload_lib_with_probes(exe: impl AsRef<Path>) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build_preload(exe.as_ref(), true)).clone()
}

/// Test peer `name` (a binary of `strait-testpeers`, e.g. `strait-preload-peer` or
/// `strait-udp-peer`). Cargo gives a test `CARGO_BIN_EXE_*` only for its own
/// package's binaries, so the first call in a test binary builds all the peers with
/// the cargo, profile and target directory of the running test (its executable is
/// `<target>/<profile>/deps/<test>-<hash>`); the peers land in that profile
/// directory, where [`preload_lib_beside`] finds the library for them too.
pub fn test_peer(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let profile_dir = BUILT.get_or_init(|| {
        let exe = std::env::current_exe().expect("path of the running test binary");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test binary in <target>/<profile>/deps")
            .to_path_buf();
        let target_dir = profile_dir.parent().expect("target dir").to_path_buf();
        cargo_build(&profile_dir, &target_dir, &["-p", "strait-testpeers", "--bins"]);
        profile_dir
    });
    let p = profile_dir.join(name);
    assert!(p.exists(), "test peer {} missing after the build of strait-testpeers", p.display());
    p
}

fn build_preload(exe: &Path, probes: bool) -> PathBuf {
    let profile_dir = exe.parent().expect("profile dir");
    let target_dir = profile_dir.parent().expect("target dir");
    let target_dir = if probes { target_dir.join("probes") } else { target_dir.to_path_buf() };
    let mut args = vec!["-p", "strait-preload", "--lib"];
    if probes {
        args.extend(["--features", "probes"]);
    }
    let built = cargo_build(profile_dir, &target_dir, &args);
    let p = built.join("libstrait_preload.so");
    assert!(p.exists(), "{} missing after the build", p.display());
    p
}

/// Runs `cargo build` (offline, quiet) of `what` with the profile of `profile_dir`
/// (`<target>/<profile>`: the test's own build) into `target_dir`, with the cargo
/// that runs the tests (`$CARGO`), so that toolchain and profile match the test's;
/// returns the profile directory in `target_dir` that holds the result.
fn cargo_build(profile_dir: &Path, target_dir: &Path, what: &[&str]) -> PathBuf {
    let profile = profile_dir.file_name().and_then(|s| s.to_str()).expect("profile name").to_string();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(cargo);
    c.args(["build", "--offline", "-q"]).args(what).arg("--target-dir").arg(target_dir);
    // The directory names the profile: `debug` is the dev profile, any other is its own.
    match profile.as_str() {
        "debug" => {}
        "release" => {
            c.arg("--release");
        }
        p => {
            c.args(["--profile", p]);
        }
    }
    let st = c.status().unwrap_or_else(|e| panic!("run cargo build {}: {e}", what.join(" ")));
    assert!(st.success(), "cargo build {} failed", what.join(" "));
    target_dir.join(&profile)
}

/// Sum of counter `name` over the `strait-preload: pid ...` statistics lines
/// (`STRAIT_STATS=1`, `strait run --stats`) in `stderr`.
pub fn stat(stderr: &str, name: &str) -> usize {
    let key = format!(" {name} ");
    stderr
        .lines()
        .filter(|l| l.starts_with("strait-preload: pid "))
        .filter_map(|l| l.split(key.as_str()).nth(1)?.split_whitespace().next()?.parse::<usize>().ok())
        .sum()
}

/// True when the test runs as root (some tests need another user or namespaces).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// True when the test runs as root; otherwise says on stderr that the test is
/// skipped and `why` (what it needs root for).
pub fn root_or_skip(why: &str) -> bool {
    let root = is_root();
    if !root {
        eprintln!("skipped: {why}");
    }
    root
}

/// Writes `body` to `strait-<prefix>-<tag>-<pid>.py` in the temporary directory,
/// readable by every user (tests run some scripts as another user).
pub fn script(prefix: &str, tag: &str, body: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("strait-{prefix}-{tag}-{}.py", std::process::id()));
    std::fs::write(&p, body).expect("write script");
    let mut perm = std::fs::metadata(&p).expect("script").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o644);
    std::fs::set_permissions(&p, perm).expect("chmod");
    p
}

/// A Python function for test scripts to put before their own text:
/// `echo_back(c, pieces)` sends each piece on the connected socket `c`, shuts down
/// its writing side, and returns every byte read back until the end of the stream.
pub const PY_ECHO_BACK: &str = r#"
import socket
def echo_back(c, pieces):
    for piece in pieces:
        c.sendall(piece)
    c.shutdown(socket.SHUT_WR)
    got = bytearray()
    while True:
        b = c.recv(65536)
        if not b:
            break
        got += b
    return got
"#;

/// True if `bin` is on the PATH.
pub fn have(bin: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Asserts that `bin` (from Debian's package `pkg`) is installed. Tests never install
/// anything: `scripts/install-deps`, which the test command runs first, does it once
/// (two tests installing at once fought over the dpkg lock).
pub fn ensure(bin: &str, pkg: &str) {
    assert!(have(bin), "{bin} is missing: run scripts/install-deps (it installs {pkg}) before the tests");
}

/// Runs a command with a time limit (killed when it expires), reading its output
/// while it runs; `None` if it could not start or ran past the limit.
pub fn run_for(c: &mut Command, limit: Duration) -> Option<Output> {
    run_limited(c, limit, false)
}

/// As [`run_for`], with the command in a process group of its own that is killed
/// whole when it ends or runs past the limit: what it started (MPI ranks, daemons)
/// does not outlive the test.
pub fn run_for_group(c: &mut Command, limit: Duration) -> Option<Output> {
    use std::os::unix::process::CommandExt;
    run_limited(c.process_group(0), limit, true)
}

fn run_limited(c: &mut Command, limit: Duration, group: bool) -> Option<Output> {
    use std::io::Read;
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().ok()?;
    let pgid = child.id() as i32;
    let kill_group = || {
        if group {
            // SAFETY: signals the process group made for this command (ESRCH once
            // it is empty).
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
    };
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
            kill_group();
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    kill_group();
    Some(Output { status, stdout: out.join().ok()?, stderr: err.join().ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_sums_the_preload_lines_only() {
        let err = "strait-preload: pid 1 tcp 3 udp 1\nother tcp 9\nstrait-preload: pid 2 tcp 4\n";
        assert_eq!(stat(err, "tcp"), 7);
        assert_eq!(stat(err, "udp"), 1);
        assert_eq!(stat(err, "none"), 0);
    }
}
