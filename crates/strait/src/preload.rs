//! Where `libstrait_preload.so` is: what `strait run` preloads, and what `strait
//! bench`'s `strait-run` transport runs its ends under.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// File name of the preload library.
pub const PRELOAD_LIB: &str = "libstrait_preload.so";

/// The preload library: `explicit` (`--preload`), else `$STRAIT_PRELOAD_LIB`, else
/// next to the running `strait` binary; canonicalized. The error says what to do.
pub fn find_lib(explicit: Option<PathBuf>) -> Result<PathBuf, String> {
    let candidate =
        explicit.or_else(|| std::env::var_os("STRAIT_PRELOAD_LIB").map(PathBuf::from)).or_else(|| {
            let exe = std::env::current_exe().ok()?;
            Some(exe.parent()?.join(PRELOAD_LIB))
        });
    match candidate {
        Some(p) if p.is_file() => p.canonicalize().map_err(|e| format!("{}: {e}", p.display())),
        Some(p) => Err(format!(
            "{} not found (build it with `cargo build --release`, or pass --preload PATH)",
            p.display()
        )),
        None => Err(format!("cannot locate {PRELOAD_LIB}: pass --preload PATH")),
    }
}

/// This `strait` binary's hidden `subcommand` as a child under the preload library
/// `lib` (as `strait run` would start a program): standard input and output piped
/// for its driver, standard error shared, killed if the driver dies.
pub fn helper_under(subcommand: &str, lib: &Path) -> Command {
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg(subcommand)
        .env("LD_PRELOAD", lib)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    // SAFETY: between fork and exec only prctl, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd
}
