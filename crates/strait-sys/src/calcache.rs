//! The per-host cache of measured protocol settings (the shm device's rendezvous
//! path, the udp device's backend): one file of `key=value` lines per calibration
//! in `$XDG_CACHE_HOME/strait/` (else `~/.cache/strait/`).
//!
//! A file is valid for the host it was measured on (the boot id, the CPU model and
//! the kernel release: a new VM or host is a new boot), and is used only if the
//! file and its folder belong to this user and nobody else can write them (a planted
//! file must not steer a choice). A measurement taken while the machine was busy
//! serves for [`BUSY_VALID_S`] only. One process measures at a time
//! ([`Cache::lock`]); the others wait for its result. What the fields mean, and
//! whether they agree with each other, is the caller's to check.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a measurement taken on a busy machine is used, seconds.
pub const BUSY_VALID_S: u64 = 600;

/// One calibration's cache file, for one host.
#[derive(Debug, Clone)]
pub struct Cache {
    path: PathBuf,
    key: String,
}

impl Cache {
    /// The cache file `name` of this user, for this host; `None` if there is no
    /// home or cache folder to put it in.
    pub fn new(name: &str) -> Option<Cache> {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(Cache::at(base.join("strait").join(name), host_key()))
    }

    /// The cache file at `path`, valid for host `key` (tests give both).
    pub fn at(path: PathBuf, key: String) -> Cache {
        Cache { path, key }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored fields (without `host`, `quiet` and `at`), if the file is private,
    /// was written for this host, and its measurement is still valid.
    pub fn load(&self) -> Option<HashMap<String, String>> {
        let p = &self.path;
        if !private(p) || !p.parent().is_some_and(private) {
            return None;
        }
        let text = std::fs::read_to_string(p).ok()?;
        let mut fields = HashMap::new();
        for line in text.lines() {
            let (k, v) = line.split_once('=')?;
            fields.insert(k.to_owned(), v.to_owned());
        }
        if fields.remove("host").as_deref() != Some(self.key.as_str()) {
            return None;
        }
        // A measurement from a busy machine serves for a while only, then is taken again.
        let at = fields.remove("at").and_then(|v| v.parse::<u64>().ok())?;
        match fields.remove("quiet").as_deref() {
            Some("1") => {}
            Some("0") if unix_now().saturating_sub(at) <= BUSY_VALID_S => {}
            _ => return None,
        }
        Some(fields)
    }

    /// Writes `fields` (folder 0700, file 0600, replaced atomically); `quiet`: the
    /// machine was quiet while measuring (else the entry expires after
    /// [`BUSY_VALID_S`]).
    pub fn store(&self, fields: &[(&str, String)], quiet: bool) -> std::io::Result<()> {
        let p = &self.path;
        let dir = p.parent().ok_or_else(|| std::io::Error::other("no folder"))?;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
        if !private(dir) {
            return Err(std::io::Error::other("cache folder not private"));
        }
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("cache");
        let tmp = dir.join(format!(".{name}.{}.{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        let mut text = format!("host={}\n", self.key);
        for (k, v) in fields {
            text.push_str(&format!("{k}={v}\n"));
        }
        text.push_str(&format!("quiet={}\nat={}\n", u8::from(quiet), unix_now()));
        f.write_all(text.as_bytes())?;
        drop(f);
        std::fs::rename(&tmp, p).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }

    /// An exclusive lock on `<name>.lock` beside the file, held while measuring;
    /// waits up to 2 s for it (a measurement takes well under that). `None` if there
    /// is no private folder to lock in, or the wait ran out (then measure anyway:
    /// never block a connection for long).
    pub fn lock(&self) -> Option<MeasureLock> {
        use std::os::fd::AsRawFd;
        let dir = self.path.parent()?;
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).ok()?;
        if !private(dir) {
            return None;
        }
        let name = self.path.file_name()?.to_str()?;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(dir.join(format!("{name}.lock")))
            .ok()?;
        let end = Instant::now() + Duration::from_secs(2);
        loop {
            // SAFETY: flock on a descriptor we own.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Some(MeasureLock { _file: f });
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The lock of [`Cache::lock`]; released when dropped (the file closes).
#[derive(Debug)]
pub struct MeasureLock {
    _file: std::fs::File,
}

/// What a cache is valid for: the boot, the CPU model and the kernel.
pub fn host_key() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.to_owned()))
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{}|{}|{}", boot.trim(), cpu.split(':').nth(1).unwrap_or("").trim(), kernel.trim())
}

/// True if the machine looked idle enough for a measurement worth keeping: fewer
/// runnable threads on average over the last minute than cores less one half (a
/// measurement of two cores' work on a busy host reads low, and that must not be
/// cached for the rest of the boot).
pub fn quiet() -> bool {
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()));
    let cores = crate::cpu::count().max(1) as f64;
    load.is_some_and(|l| l < cores - 0.5)
}

/// Seconds since the epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// True if `p` belongs to this user and nobody else may write it.
fn private(p: &Path) -> bool {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    std::fs::symlink_metadata(p)
        .is_ok_and(|m| m.uid() == me && m.mode() & 0o022 == 0 && !m.file_type().is_symlink())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A cache `name` for host `h` in a fresh private folder for `tag`.
    fn fresh(tag: &str) -> (PathBuf, Cache) {
        let d = std::env::temp_dir().join(format!("strait-calcache-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::DirBuilder::new().mode(0o700).create(&d).unwrap();
        let c = Cache::at(d.join("cal"), "h".into());
        (d, c)
    }

    #[test]
    fn fields_round_trip_only_for_their_host() {
        let (d, c) = fresh("rt");
        c.store(&[("choice", "x".into()), ("gbps", "9.5".into())], true).unwrap();
        let f = c.load().expect("valid cache");
        assert_eq!(f.get("choice").map(String::as_str), Some("x"));
        assert_eq!(f.get("gbps").map(String::as_str), Some("9.5"));
        assert!(!f.contains_key("host") && !f.contains_key("quiet") && !f.contains_key("at"));
        assert!(Cache::at(c.path().to_owned(), "other".into()).load().is_none(), "another host's cache used");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_file_anyone_could_have_written_is_ignored() {
        let (d, c) = fresh("perm");
        c.store(&[("choice", "x".into())], true).unwrap();
        std::fs::set_permissions(c.path(), std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(c.load().is_none(), "a world-writable cache was trusted");
        std::fs::set_permissions(c.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(c.load().is_none(), "a cache in a world-writable folder was trusted");
        assert!(c.store(&[], true).is_err(), "stored into a world-writable folder");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(c.load().is_some());
        std::fs::write(c.path(), "garbage").unwrap();
        assert!(c.load().is_none());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_measurement_from_a_busy_machine_expires() {
        let (d, c) = fresh("busy");
        c.store(&[], false).unwrap();
        assert!(c.load().is_some(), "a fresh busy measurement serves");
        let old = unix_now() - BUSY_VALID_S - 1;
        std::fs::write(c.path(), format!("host=h\nquiet=0\nat={old}\n")).unwrap();
        assert!(c.load().is_none(), "an old busy measurement was still used");
        std::fs::write(c.path(), format!("host=h\nquiet=1\nat={old}\n")).unwrap();
        assert!(c.load().is_some(), "a quiet measurement serves for the whole boot");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn one_measures_at_a_time() {
        let (d, c) = fresh("lock");
        let held = c.lock().expect("the lock");
        let f = std::fs::OpenOptions::new().read(true).open(d.join("cal.lock")).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor we own.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(r, -1, "a second lock was granted while the first was held");
        drop(held);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        let _ = std::fs::remove_dir_all(&d);
    }
}
