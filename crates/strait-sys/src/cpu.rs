//! Pinning the calling thread to one CPU (measurements that must run on two distinct
//! cores: `strait anatomy`'s ping-pong ends, the shm device's calibration).

/// Pins the calling thread to `cpu` (best effort: a failure only costs noise) and
/// returns the CPU set it had, for [`unpin`].
pub fn pin(cpu: usize) -> Option<libc::cpu_set_t> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills
    // `old`, CPU_SET writes inside `set`, and sched_setaffinity(0, ..) reads it for
    // the calling thread only.
    unsafe {
        let mut old: libc::cpu_set_t = std::mem::zeroed();
        let got = libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut old) == 0;
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        got.then_some(old)
    }
}

/// Gives the calling thread back the CPU set [`pin`] returned.
pub fn unpin(old: Option<libc::cpu_set_t>) {
    if let Some(set) = old {
        // SAFETY: `set` is a CPU set the kernel filled in; the call only reads it.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    }
}

/// How many CPUs the calling thread may run on (its affinity mask); 0 if unknown.
/// One system call, no allocation, no libc function the preload interposes (std's
/// `available_parallelism` also reads cgroup files through libc's `open` and `read`,
/// which inside the preload land in its own shims).
pub fn count() -> usize {
    // SAFETY: a zeroed cpu_set_t is a valid empty set that sched_getaffinity fills;
    // CPU_COUNT only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return 0;
        }
        libc::CPU_COUNT(&set) as usize
    }
}

/// The CPUs the calling thread may run on, in order (empty if unknown).
pub fn allowed() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set that sched_getaffinity fills;
    // CPU_ISSET only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}
