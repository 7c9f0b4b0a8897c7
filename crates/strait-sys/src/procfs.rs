//! Reading `/proc` inside the preload: raw `openat`, `read`, `readlinkat`,
//! `getdents64` and `close` system calls, since the preload interposes libc's `read`
//! and `close` (and its `close` takes locks that a caller may hold).
//!
//! Look-ups go through a handle on `/proc` opened when the library is loaded
//! ([`open_root`], [`set_root`]), not through the path `/proc`: a program that later
//! calls `chroot` or `pivot_root` into a tree without `/proc` (privilege-separated
//! daemons do, right after they start) still has its `/proc/self/fd` and the rest
//! through the handle. `self` is resolved by the kernel at each look-up, so the one
//! handle serves forked children too.

use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicI32, Ordering};

use libc::c_int;

/// The handle on `/proc` (an `O_PATH` directory), or -1: then paths are looked up
/// from the process's root.
static ROOT: AtomicI32 = AtomicI32::new(-1);

/// Opens `/proc` as a handle for later look-ups (`O_PATH | O_DIRECTORY`,
/// close-on-exec: the next program image opens its own). The caller places it
/// (the library moves its descriptors above the program's) and gives it to
/// [`set_root`]. `None` where `/proc` is not mounted.
pub fn open_root() -> Option<c_int> {
    openat(libc::AT_FDCWD, c"/proc", libc::O_PATH | libc::O_DIRECTORY)
}

/// The raw `openat` system call (close-on-exec added); `None` if it fails.
fn openat(dir: c_int, path: &CStr, flags: c_int) -> Option<c_int> {
    // SAFETY: a NUL-terminated path; plain system call.
    let fd = unsafe { libc::syscall(libc::SYS_openat, dir, path.as_ptr(), flags | libc::O_CLOEXEC) };
    c_int::try_from(fd).ok().filter(|&fd| fd >= 0)
}

/// Makes `fd` (from [`open_root`]) the handle every look-up here goes through.
pub fn set_root(fd: c_int) {
    ROOT.store(fd, Ordering::Relaxed);
}

/// The handle on `/proc` in use, if any.
pub fn root() -> Option<c_int> {
    Some(ROOT.load(Ordering::Relaxed)).filter(|&fd| fd >= 0)
}

/// `rel` (a path under `/proc`, such as `self/fd/3`) as the directory and path to
/// look it up with: the handle and `rel`, or the root's `/proc/rel`.
fn locate(rel: &str) -> Option<(c_int, CString)> {
    match root() {
        Some(dir) => Some((dir, CString::new(rel).ok()?)),
        None => Some((libc::AT_FDCWD, CString::new(format!("/proc/{rel}")).ok()?)),
    }
}

/// Opens `rel` under `/proc` with `flags` (close-on-exec added); the caller owns
/// the descriptor. `None` if it cannot be opened.
pub fn open(rel: &str, flags: c_int) -> Option<c_int> {
    let (dir, path) = locate(rel)?;
    openat(dir, &path, flags)
}

/// The target of the symbolic link `rel` under `/proc` (such as `self/fd/3`, whose
/// target names a descriptor's kind: `anon_inode:[eventpoll]`), at most 256 bytes.
pub fn readlink(rel: &str) -> Option<Vec<u8>> {
    let (dir, path) = locate(rel)?;
    let mut buf = [0u8; 256];
    // SAFETY: a NUL-terminated path and a local buffer of its length.
    let n = unsafe { libc::syscall(libc::SYS_readlinkat, dir, path.as_ptr(), buf.as_mut_ptr(), buf.len()) };
    let n = usize::try_from(n).ok().filter(|&n| n > 0 && n < buf.len())?;
    Some(buf[..n].to_vec())
}

/// What descriptor `fd` of this process is, as `/proc/self/fd/N` names it (such
/// as `anon_inode:[eventfd]` or `socket:[123]`).
pub fn fd_kind(fd: c_int) -> Option<Vec<u8>> {
    readlink(&format!("self/fd/{fd}"))
}

/// The inode of `rel` under `/proc` (such as `self/ns/net`, whose inode names the
/// network namespace), following links.
pub fn inode(rel: &str) -> Option<u64> {
    let (dir, path) = locate(rel)?;
    // SAFETY: stat is plain old data, filled by the call.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a local stat.
    (unsafe { libc::fstatat(dir, path.as_ptr(), &mut st, 0) } == 0).then_some(st.st_ino)
}

/// The whole content of `rel` under `/proc`; as [`read_raw`].
pub fn read(rel: &str, limit: usize) -> Option<Vec<u8>> {
    let fd = open(rel, libc::O_RDONLY)?;
    read_fd(fd, limit)
}

/// Whether process `pid` is stopped now (a job-control stop, `SIGSTOP`, or a
/// tracer's stop: state `T` or `t` in `PID/stat`); `None` if that cannot be read (no
/// such process, another pid namespace, no `/proc`).
pub fn stopped(pid: libc::pid_t) -> Option<bool> {
    let stat = read(&format!("{pid}/stat"), 1024)?;
    // The state follows the command name, which may itself hold ") ".
    let after = stat.iter().rposition(|&b| b == b')')?;
    let state = *stat.get(after + 2)?;
    Some(matches!(state, b'T' | b't'))
}

/// The descriptors this process has open now (`self/fd`), sorted; `None` if they
/// cannot be listed.
pub fn own_fds() -> Option<Vec<c_int>> {
    let dir = open("self/fd", libc::O_RDONLY | libc::O_DIRECTORY)?;
    let mut fds = Vec::new();
    let mut buf = [0u8; 4096];
    let ok = loop {
        // SAFETY: fills a local buffer of its length with `linux_dirent64` records.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, dir, buf.as_mut_ptr(), buf.len()) };
        let Ok(n) = usize::try_from(n) else { break false };
        if n == 0 {
            break true;
        }
        // Each record: inode (8), offset (8), record length (2), type (1), name.
        let mut at = 0;
        while at + 19 < n {
            let len = usize::from(u16::from_ne_bytes([buf[at + 16], buf[at + 17]]));
            if len < 19 || at + len > n {
                break;
            }
            let name = &buf[at + 19..at + len];
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            if let Some(fd) = std::str::from_utf8(name).ok().and_then(|t| t.parse::<c_int>().ok()) {
                // (The listing's own descriptor is not the program's.)
                if fd != dir {
                    fds.push(fd);
                }
            }
            at += len;
        }
    };
    // SAFETY: our descriptor, closed once.
    unsafe { libc::syscall(libc::SYS_close, dir) };
    fds.sort_unstable();
    ok.then_some(fds)
}

/// The whole content of `path` (any path, looked up from the process's root);
/// `None` if it cannot be opened or read or is longer than `limit` bytes (a part
/// could mislead).
pub fn read_raw(path: &CStr, limit: usize) -> Option<Vec<u8>> {
    read_fd(openat(libc::AT_FDCWD, path, libc::O_RDONLY)?, limit)
}

/// Reads `fd` to its end and closes it.
fn read_fd(fd: c_int, limit: usize) -> Option<Vec<u8>> {
    let mut out: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    let ok = loop {
        // SAFETY: reads into a local buffer of its length.
        let n = unsafe { libc::syscall(libc::SYS_read, fd, chunk.as_mut_ptr(), chunk.len()) };
        let Ok(n) = usize::try_from(n) else { break false };
        if n == 0 {
            break true;
        }
        if out.len() + n > limit {
            break false;
        }
        out.extend_from_slice(&chunk[..n]);
    };
    // SAFETY: our descriptor, closed once.
    unsafe { libc::syscall(libc::SYS_close, fd) };
    ok.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_proc_file_whole_or_not_at_all() {
        let all = read_raw(c"/proc/self/status", 1 << 20).expect("this test runs with /proc");
        assert!(all.len() > 4096 / 4 && all.starts_with(b"Name:"));
        // (Its figures may change between reads, and its length with them.)
        assert!(read_raw(c"/proc/self/status", all.len() + 4096).is_some());
        assert_eq!(read_raw(c"/proc/self/status", 10), None, "longer than the limit");
        assert_eq!(read_raw(c"/no/such/file", 10), None);
    }

    #[test]
    fn a_stopped_process_is_seen_as_stopped() {
        // SAFETY: fork in a test; the child only pauses until killed.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            loop {
                // SAFETY: plain system call.
                unsafe { libc::pause() };
            }
        }
        let running = stopped(pid);
        // SAFETY: signals to our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let mut seen = false;
        for _ in 0..1000 {
            if stopped(pid) == Some(true) {
                seen = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // SAFETY: as above; reaps the child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        assert_eq!(running, Some(false), "a sleeping child read as stopped");
        assert!(seen, "a stopped child was never seen as stopped");
        assert_eq!(stopped(pid), None, "a reaped child still has a state");
    }

    /// Through the handle, `/proc` answers after a `chroot` into a tree without it,
    /// for this process and for a child forked after; without the handle it does not.
    #[test]
    fn the_handle_answers_after_a_chroot_into_a_tree_without_proc() {
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: chroot needs root");
            return;
        }
        let jail = std::env::temp_dir().join(format!("strait-procfs-jail-{}", std::process::id()));
        std::fs::create_dir_all(&jail).expect("jail");
        let jail_c = CString::new(jail.to_str().expect("path")).expect("path");
        // SAFETY: fork in a test; the child makes only system calls and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // The child: its own root from here on.
            let code = (|| {
                let root = open_root().ok_or(10)?;
                set_root(root);
                // SAFETY: plain system calls with a NUL-terminated path.
                if unsafe { libc::chroot(jail_c.as_ptr()) } != 0 || unsafe { libc::chdir(c"/".as_ptr()) } != 0
                {
                    return Err(11);
                }
                if read_raw(c"/proc/self/stat", 4096).is_some() {
                    return Err(12);
                }
                let stat = read("self/stat", 4096).ok_or(13)?;
                if !stat.starts_with(format!("{} ", std::process::id()).as_bytes()) {
                    return Err(14);
                }
                let fds = own_fds().ok_or(15)?;
                if !fds.contains(&root) || fds.contains(&-1) {
                    return Err(16);
                }
                if readlink(&format!("self/fd/{root}")).as_deref() != Some(b"/proc".as_slice()) {
                    return Err(17);
                }
                let o = open(&format!("self/fd/{root}"), libc::O_PATH).ok_or(18)?;
                // SAFETY: plain syscalls.
                unsafe { libc::close(o) };
                // A child forked now resolves `self` to itself.
                // SAFETY: fork; the grandchild makes system calls and exits.
                let g = unsafe { libc::fork() };
                if g == 0 {
                    let ok = read("self/stat", 4096)
                        .is_some_and(|s| s.starts_with(format!("{} ", std::process::id()).as_bytes()));
                    // SAFETY: leaving the forked grandchild.
                    unsafe { libc::_exit(if ok { 0 } else { 1 }) };
                }
                let mut st = 0;
                // SAFETY: our child; a local status.
                unsafe { libc::waitpid(g, &mut st, 0) };
                if st != 0 {
                    return Err(19);
                }
                Ok(())
            })();
            // SAFETY: leaving the forked child without running the test harness.
            unsafe { libc::_exit(code.err().unwrap_or(0)) };
        }
        let mut status = 0;
        // SAFETY: our child; a local status.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        let _ = std::fs::remove_dir_all(&jail);
        assert!(libc::WIFEXITED(status), "child died: {status}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "which check failed (10..19)");
    }
}
