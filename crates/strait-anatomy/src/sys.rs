//! Operating-system counters: process CPU time and real system calls.
//!
//! System calls are counted with `perf_event_open` on the tracepoint
//! `raw_syscalls:sys_enter`, for the calling thread only. The tracepoint id comes from
//! tracefs (`/sys/kernel/tracing`, or `/sys/kernel/debug/tracing`); if neither is
//! mounted this tries to mount tracefs at `/sys/kernel/tracing` (root only).

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use thiserror::Error;

/// CPU time consumed by the whole process so far (all threads, user + system), in
/// nanoseconds, from `CLOCK_PROCESS_CPUTIME_ID`. This is a real system call (the vDSO
/// does not serve CPU-time clocks): call it outside the measured loop.
pub fn process_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the local we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Why system calls cannot be counted on this machine.
#[derive(Debug, Error)]
pub enum SyscallCountError {
    /// No tracefs with the `raw_syscalls:sys_enter` event was found or mountable.
    #[error("tracepoint raw_syscalls:sys_enter not found (tracefs not mounted at /sys/kernel/tracing or /sys/kernel/debug/tracing, and mounting failed: {0})")]
    NoTracepoint(String),
    /// `perf_event_open` refused (permissions, `perf_event_paranoid`, seccomp, no perf
    /// support in the kernel).
    #[error("perf_event_open(raw_syscalls:sys_enter) failed: {0} (need root or perf_event_paranoid <= -1 for tracepoints)")]
    PerfOpen(io::Error),
    /// Reading the counter failed.
    #[error("reading the syscall counter failed: {0}")]
    Read(io::Error),
}

const TRACEFS_DIRS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];
const SYS_ENTER_ID: &str = "events/raw_syscalls/sys_enter/id";

fn read_tracepoint_id() -> Option<u64> {
    TRACEFS_DIRS
        .iter()
        .find_map(|d| fs::read_to_string(format!("{d}/{SYS_ENTER_ID}")).ok()?.trim().parse().ok())
}

/// The id of `raw_syscalls:sys_enter`, mounting tracefs if it is not mounted yet and
/// this process may mount it.
pub fn sys_enter_tracepoint_id() -> Result<u64, SyscallCountError> {
    if let Some(id) = read_tracepoint_id() {
        return Ok(id);
    }
    let mount_err = {
        let src = c"tracefs";
        let target = c"/sys/kernel/tracing";
        // SAFETY: all pointers are NUL-terminated static strings; data is null.
        let r = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), src.as_ptr(), 0, std::ptr::null()) };
        if r == 0 {
            None
        } else {
            Some(io::Error::last_os_error().to_string())
        }
    };
    read_tracepoint_id().ok_or_else(|| {
        SyscallCountError::NoTracepoint(mount_err.unwrap_or_else(|| "mounted, but no such event".into()))
    })
}

/// `struct perf_event_attr`, version 0 layout (64 bytes), which every kernel accepts.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const PERF_TYPE_TRACEPOINT: u32 = 2;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// `exclude_hv` (bit 6): the hypervisor is irrelevant to a syscall count.
const ATTR_EXCLUDE_HV: u64 = 1 << 6;

/// Counts the system calls the calling thread enters.
///
/// Reading the counter is itself a system call (`read`); [`SyscallCounter::read`]
/// subtracts that, so the difference of two reads counts exactly the calls made in
/// between.
#[derive(Debug)]
pub struct SyscallCounter {
    fd: OwnedFd,
    /// System calls attributed to one read of the counter (normally 1).
    read_cost: u64,
}

impl SyscallCounter {
    /// Opens a counter for the calling thread (enabled at once).
    pub fn open() -> Result<SyscallCounter, SyscallCountError> {
        let id = sys_enter_tracepoint_id()?;
        let attr = PerfEventAttr {
            type_: PERF_TYPE_TRACEPOINT,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: id,
            flags: ATTR_EXCLUDE_HV,
            ..Default::default()
        };
        // SAFETY: `attr` is a valid perf_event_attr (version 0 size) living across the
        // call; pid 0 / cpu -1 = this thread on any CPU; no group fd.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr as *const PerfEventAttr,
                0 as libc::pid_t,
                -1 as libc::c_int,
                -1 as libc::c_int,
                PERF_FLAG_FD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(SyscallCountError::PerfOpen(io::Error::last_os_error()));
        }
        // SAFETY: perf_event_open returned a new fd owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        let mut c = SyscallCounter { fd, read_cost: 0 };
        // Calibrate: back-to-back reads differ by exactly the reads' own entries.
        let mut cost = u64::MAX;
        for _ in 0..5 {
            let a = c.raw()?;
            let b = c.raw()?;
            cost = cost.min(b.saturating_sub(a));
        }
        c.read_cost = cost;
        Ok(c)
    }

    fn raw(&self) -> Result<u64, SyscallCountError> {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a local u64 from our perf fd.
        let r = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if r != 8 {
            return Err(SyscallCountError::Read(io::Error::last_os_error()));
        }
        Ok(v)
    }

    /// The raw count of system calls this thread has entered. Only the [`delta`]
    /// of two reads is meaningful.
    ///
    /// [`delta`]: SyscallCounter::delta
    pub fn read(&self) -> Result<u64, SyscallCountError> {
        self.raw()
    }

    /// The number of system calls made between the reads that returned `before` and
    /// `after` (the second read's own entry is removed).
    pub fn delta(&self, before: u64, after: u64) -> u64 {
        after.saturating_sub(before).saturating_sub(self.read_cost)
    }
}

/// Creates an anonymous shared-memory file (`memfd_create`) of `len` bytes.
pub fn memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: `name` is NUL-terminated; flags are plain constants.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new fd owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on the fd we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Sleeps on a shared (cross-process) futex word while it equals `expected`, at most
/// `timeout`. Spurious returns are possible; callers re-check their condition.
pub fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32, timeout: std::time::Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 (possibly in shared memory); FUTEX_WAIT
    // without the PRIVATE flag works across processes; `ts` is a local timespec.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

/// Wakes every waiter sleeping on a shared futex word.
pub fn futex_wake(word: &std::sync::atomic::AtomicU32) {
    // SAFETY: `word` is a live, aligned u32; FUTEX_WAKE only reads its address.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

/// Model name of the first CPU in `/proc/cpuinfo`.
pub fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// `(kernel release, hostname)` from `uname`.
pub fn uname() -> (String, String) {
    // SAFETY: utsname is plain old data; zeroed is a valid value.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: uname fills the struct we pass.
    if unsafe { libc::uname(&mut u) } != 0 {
        return ("unknown".into(), "unknown".into());
    }
    let field = |f: &[libc::c_char]| {
        let bytes: Vec<u8> = f.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    (field(&u.release), field(&u.nodename))
}

pub use strait_sys::cpu::{pin, unpin};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_advances() {
        let a = process_cpu_ns();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_add(std::hint::black_box(i));
        }
        std::hint::black_box(x);
        assert!(process_cpu_ns() > a);
    }

    #[test]
    fn syscall_counter_counts_exactly() {
        let c = match SyscallCounter::open() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("syscall counting unavailable here, test skipped: {e}");
                return;
            }
        };
        let a = c.read().unwrap();
        let b = c.read().unwrap();
        assert_eq!(c.delta(a, b), 0);
        let a = c.read().unwrap();
        for _ in 0..10 {
            // SAFETY: getppid has no arguments and cannot fail.
            unsafe { libc::syscall(libc::SYS_getppid) };
        }
        let b = c.read().unwrap();
        assert_eq!(c.delta(a, b), 10);
    }
}
