//! Test support shared by strait's crates (a dev-dependency only, never published):
//! what the process tests of `strait-preload` and `strait` both need.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `libstrait_preload.so` beside `exe` (a binary of the test's build, e.g. a peer or
/// `strait`). `cargo test` does not build cdylibs, so the first call in a test binary
/// builds it with the same cargo, profile and target directory as `exe`.
pub fn preload_lib_beside(exe: &str) -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| build_preload(Path::new(exe))).clone()
}

fn build_preload(exe: &Path) -> PathBuf {
    let profile_dir = exe.parent().expect("profile dir");
    let profile = profile_dir.file_name().and_then(|s| s.to_str()).expect("profile name").to_string();
    let target_dir = profile_dir.parent().expect("target dir");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut c = Command::new(cargo);
    c.args(["build", "--offline", "-q", "-p", "strait-preload", "--lib", "--target-dir"]).arg(target_dir);
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
