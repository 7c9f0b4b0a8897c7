//! Reading a small file of `/proc` (or any path) inside the preload: raw `openat`,
//! `read` and `close` system calls, since the preload interposes libc's `read` and
//! `close` (and its `close` takes locks that a caller may hold).

use std::ffi::CStr;

/// The whole content of `path`; `None` if it cannot be opened or read (no `/proc`
/// after a `chroot`, for one) or is longer than `limit` bytes (a part could mislead).
pub fn read_raw(path: &CStr, limit: usize) -> Option<Vec<u8>> {
    // SAFETY: a NUL-terminated path; plain system call.
    let fd = unsafe {
        libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC)
    };
    if fd < 0 {
        return None;
    }
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
}
