//! Where `libstrait_preload.so` is: what `strait run` preloads, and what `strait
//! bench`'s `strait-run` transport runs its ends under.

use std::path::PathBuf;

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
