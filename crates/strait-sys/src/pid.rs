//! This process's id without a system call on every use: cached on first use and
//! forgotten in a forked child (which has an id of its own).

use std::sync::atomic::{AtomicU32, Ordering};

/// The cached id; 0 until first use and after [`forget_pid`].
static PID: AtomicU32 = AtomicU32::new(0);

/// This process's id.
pub fn current_pid() -> u32 {
    match PID.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: getpid has no preconditions.
            let p = unsafe { libc::getpid() } as u32;
            PID.store(p, Ordering::Relaxed);
            p
        }
        p => p,
    }
}

/// Drops the cached id. Call it in a forked child (e.g. from a `pthread_atfork`
/// child handler) before anything asks for [`current_pid`].
pub fn forget_pid() {
    PID.store(0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_and_forgotten() {
        assert_eq!(current_pid(), std::process::id());
        forget_pid();
        assert_eq!(current_pid(), std::process::id());
    }
}
