//! Helpers shared by the attack tests: a raw implementation of the connector's side
//! of the handshake (so a test can be a hostile peer), and child processes that run
//! as another user.
#![allow(dead_code)]

use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

pub const MAGIC: u64 = 0x3130_4d48_5354_5253;
pub const VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 4096;
/// The uid (and gid) attackers of another user run as.
pub const NOBODY: u32 = 65534;

pub fn unique(tag: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!("test-{}-{}-{}", tag, std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// Re-executes this test binary's `child` test with `STRAIT_TEST_ROLE=role`,
/// optionally as uid/gid 65534 with no supplementary groups.
pub fn spawn_role(role: &str, name: &str, as_nobody: bool) -> Child {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("STRAIT_TEST_ROLE", role)
        .env("STRAIT_TEST_NAME", name);
    if as_nobody {
        // std drops supplementary groups (setgroups(0)) when changing uid as root.
        cmd.uid(NOBODY).gid(NOBODY);
    }
    // SAFETY: prctl between fork and exec is async-signal-safe; it runs after the uid
    // change (which would clear it) and makes the child die with the test.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn().expect("spawn child")
}

fn addr(name: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: plain old data.
    let mut sa: libc::sockaddr_un = unsafe { zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let mut bytes = vec![0u8];
    bytes.extend_from_slice(b"strait.shm.");
    bytes.extend_from_slice(name.as_bytes());
    for (d, s) in sa.sun_path.iter_mut().zip(&bytes) {
        *d = *s as libc::c_char;
    }
    (sa, (size_of::<libc::sa_family_t>() + bytes.len()) as libc::socklen_t)
}

/// A bare connection to the listener `name` that says nothing.
pub fn raw_connect(name: &str) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh fd.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let (sa, len) = addr(name);
    // SAFETY: initialised address of the stated length.
    if unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_un).cast(), len) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(sock)
}

pub fn sealed_memfd(len: u64) -> OwnedFd {
    strait_sys::sealed_memfd(c"strait-shm", len as usize).expect("sealed memfd")
}

pub fn eventfd() -> OwnedFd {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fresh fd.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

pub fn send_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> bool {
    strait_sys::send_fds(sock, data, fds, libc::MSG_NOSIGNAL).is_ok_and(|n| n == data.len())
}

/// One message and the descriptors it carried (room for 12); -1 and none on error.
pub fn recv_fds(sock: RawFd, buf: &mut [u8]) -> (isize, Vec<OwnedFd>) {
    match strait_sys::recv_fds(sock, buf, libc::MSG_CMSG_CLOEXEC, 12) {
        Ok(m) => (m.len as isize, m.fds),
        Err(_) => (-1, Vec::new()),
    }
}

/// Sends a hello asking for rings of `ring_pages` pages, with a sealed memfd of
/// `memfd_len` bytes and an eventfd; returns the socket, memfd and eventfd.
pub fn raw_hello(name: &str, ring_pages: u32, memfd_len: u64) -> (OwnedFd, OwnedFd, OwnedFd) {
    raw_hello_probe(name, ring_pages, memfd_len, 0x1000)
}

/// [`raw_hello`] with the address the listener probes with `process_vm_readv`.
pub fn raw_hello_probe(
    name: &str,
    ring_pages: u32,
    memfd_len: u64,
    probe: u64,
) -> (OwnedFd, OwnedFd, OwnedFd) {
    let sock = raw_connect(name).expect("connect");
    let memfd = sealed_memfd(memfd_len);
    let wake = eventfd();
    let mut hello = [0u8; 32];
    hello[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    hello[8..12].copy_from_slice(&VERSION.to_le_bytes());
    hello[12..16].copy_from_slice(&ring_pages.to_le_bytes());
    hello[16..24].copy_from_slice(&probe.to_le_bytes());
    if memfd_len >= 8 {
        let map = strait_sys::Mapping::shared(memfd.as_raw_fd(), 4096, 0).expect("mmap the memfd");
        // SAFETY: the first 8 bytes of the mapping lie inside the memfd (`memfd_len >= 8`).
        unsafe { std::ptr::write_volatile(map.ptr().cast::<u64>(), MAGIC) };
    }
    assert!(send_fds(sock.as_raw_fd(), &hello, &[memfd.as_raw_fd(), wake.as_raw_fd()]));
    (sock, memfd, wake)
}

/// The number of descriptors this process has open.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}
