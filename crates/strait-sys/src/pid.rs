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

/// How many threads this process has, from `/proc/self/stat` (its 20th field,
/// counted after the command name, which may itself hold spaces and parentheses).
/// `None` when it cannot be read (no `/proc`, as after a `chroot`): callers then
/// assume several. Read with [`crate::procfs::read`] (the preload interposes
/// `read` and `close`; the handle on `/proc` outlives a `chroot`).
pub fn thread_count() -> Option<usize> {
    let stat = crate::procfs::read("self/stat", 4096)?;
    // The command name is bytes, not always UTF-8; the fields after it are ASCII.
    thread_count_in(&String::from_utf8_lossy(&stat))
}

/// [`thread_count`] of one `/proc/<pid>/stat` line.
fn thread_count_in(stat: &str) -> Option<usize> {
    // Fields after the command: state is field 3, num_threads field 20.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(17)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_counted_from_the_stat_line() {
        let line = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 7 0 12345 1000 10";
        assert_eq!(thread_count_in(line), Some(7));
        assert_eq!(thread_count_in("garbage"), None);
        let before = thread_count().expect("this test runs with /proc");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || rx.recv());
        assert!(thread_count().expect("/proc") > before.saturating_sub(1));
        assert!(thread_count().expect("/proc") >= 2);
        drop(tx);
        let _ = t.join();
    }

    #[test]
    fn cached_and_forgotten() {
        assert_eq!(current_pid(), std::process::id());
        forget_pid();
        assert_eq!(current_pid(), std::process::id());
    }
}
