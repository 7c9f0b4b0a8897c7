//! The secret shared by hosts that carry each other's TCP connections
//! (`strait run --peers-secret FILE`, `STRAIT_PEERS_SECRET_FILE`).
//!
//! The file holds the secret itself: any bytes, surrounding whitespace ignored, 16
//! to 4096 of them (`head -c 32 /dev/urandom | base64 > FILE`). Like ssh with a
//! private key, a file that other users may read or change is refused, as is one
//! owned by another user (root's files excepted). Errors name the variable and the
//! file: a secret that was asked for is never silently left out.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use strait_wire::auth::PacketKey;
use thiserror::Error;

/// The variable naming the secret file.
pub const SECRET_ENV: &str = "STRAIT_PEERS_SECRET_FILE";
/// Fewest bytes of a secret.
pub const MIN_SECRET_LEN: usize = 16;
/// Most bytes of a secret.
pub const MAX_SECRET_LEN: usize = 4096;

/// Why a secret file could not be used.
#[derive(Debug, Error)]
pub enum SecretError {
    /// The file could not be opened or read.
    #[error("{var}={}: cannot read the peers secret: {source}", path.display())]
    Unreadable {
        /// Variable (or flag) that named the file.
        var: &'static str,
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// Not a regular file.
    #[error("{var}={}: the peers secret must be a regular file", path.display())]
    NotAFile {
        /// Variable (or flag) that named the file.
        var: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// Group or other users may read or write it.
    #[error(
        "{var}={}: permissions {mode:04o} are too open: other users could read or change the peers \
         secret (chmod 600 it)",
        path.display()
    )]
    TooOpen {
        /// Variable (or flag) that named the file.
        var: &'static str,
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Owned by a user other than this one (and not root).
    #[error("{var}={}: the peers secret is owned by uid {owner}, not by this user", path.display())]
    WrongOwner {
        /// Variable (or flag) that named the file.
        var: &'static str,
        /// The file.
        path: PathBuf,
        /// Its owner.
        owner: u32,
    },
    /// Too short or too long once surrounding whitespace is trimmed.
    #[error(
        "{var}={}: the peers secret is {len} bytes (surrounding whitespace ignored); it must be \
         {MIN_SECRET_LEN} to {MAX_SECRET_LEN}",
        path.display()
    )]
    BadLength {
        /// Variable (or flag) that named the file.
        var: &'static str,
        /// The file.
        path: PathBuf,
        /// Bytes found.
        len: usize,
    },
}

/// Reads and checks the secret file `path` (named by `var` in errors) and returns
/// the key every other key of strait's cross-host protocol is derived from.
pub fn load_secret_file(var: &'static str, path: &Path) -> Result<PacketKey, SecretError> {
    let unreadable = |source| SecretError::Unreadable { var, path: path.to_path_buf(), source };
    let mut f = std::fs::File::open(path).map_err(unreadable)?;
    // The checks look at the file that was opened, not at whatever the name points
    // to a moment later.
    let meta = f.metadata().map_err(unreadable)?;
    if !meta.is_file() {
        return Err(SecretError::NotAFile { var, path: path.to_path_buf() });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(SecretError::TooOpen { var, path: path.to_path_buf(), mode });
    }
    // SAFETY: plain syscall, no arguments.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        return Err(SecretError::WrongOwner { var, path: path.to_path_buf(), owner: meta.uid() });
    }
    let mut bytes = Vec::new();
    f.by_ref().take(MAX_SECRET_LEN as u64 * 2 + 1).read_to_end(&mut bytes).map_err(unreadable)?;
    let secret = bytes.trim_ascii();
    if !(MIN_SECRET_LEN..=MAX_SECRET_LEN).contains(&secret.len()) {
        return Err(SecretError::BadLength { var, path: path.to_path_buf(), len: secret.len() });
    }
    Ok(PacketKey::new(secret).derive(b"strait peers secret v1", &[]))
}

/// The secret named by [`SECRET_ENV`]: `Ok(None)` if the variable is unset or
/// empty.
pub fn secret_from_env() -> Result<Option<PacketKey>, SecretError> {
    match std::env::var_os(SECRET_ENV) {
        Some(p) if !p.is_empty() => load_secret_file(SECRET_ENV, Path::new(&p)).map(Some),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file(name: &str, body: &[u8], mode: u32) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("strait-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join(name);
        std::fs::write(&p, body).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        p
    }

    #[test]
    fn good_bad_and_open_secret_files() {
        let a = load_secret_file("V", &file("a", b"0123456789abcdef\n", 0o600)).expect("good");
        let b = load_secret_file("V", &file("b", b"  0123456789abcdef  ", 0o400)).expect("good");
        assert_eq!(a, b, "surrounding whitespace is not part of the secret");
        let c = load_secret_file("V", &file("c", b"0123456789abcdeg", 0o600)).expect("good");
        assert_ne!(a, c);
        let e = load_secret_file("V", &file("d", b"0123456789abcdef", 0o644)).expect_err("open");
        assert!(matches!(e, SecretError::TooOpen { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().starts_with("V=") && e.to_string().contains("chmod 600"), "{e}");
        let e = load_secret_file("V", &file("e", b"short\n", 0o600)).expect_err("short");
        assert!(matches!(e, SecretError::BadLength { len: 5, .. }), "{e}");
        let e = load_secret_file("V", &file("f", &[b'x'; 5000], 0o600)).expect_err("long");
        assert!(matches!(e, SecretError::BadLength { .. }), "{e}");
        let e = load_secret_file("V", Path::new("/nonexistent/strait-secret")).expect_err("missing");
        assert!(matches!(e, SecretError::Unreadable { .. }) && e.to_string().contains("V="), "{e}");
        let e = load_secret_file("V", &std::env::temp_dir()).expect_err("dir");
        assert!(matches!(e, SecretError::NotAFile { .. } | SecretError::TooOpen { .. }), "{e}");
    }
}
