//! A new process: the fork handlers (the child holds every connection too), the
//! fork watch that notices a process made without them (a raw `clone`), and what a
//! process does at exit.

use std::panic::catch_unwind;
use std::sync::atomic::Ordering;

use crate::{conn, remote, table, udp};

extern "C" fn before_fork() {
    // The child holds every connection too: the peer must not see end of stream
    // until both have closed it.
    let _ = catch_unwind(|| {
        // (Connections still being settled too: a remote one settles in the parent
        // after the fork, and the child must then count.)
        for c in table::all_conns() {
            c.add_holder();
        }
        for u in crate::table::all_udp() {
            u.add_holder();
        }
        table::lock_for_fork();
        // The process pairs and the threads' hubs (in that order everywhere: a
        // pair is made under the first, and its memfd kept in the vault).
        crate::pair::before_fork();
        crate::hub::before_fork();
        // The child's ring of memfds, filled now (no other process touches it).
        crate::vault::before_fork();
    });
}

extern "C" fn in_parent() {
    let _ = catch_unwind(|| crate::vault::after_fork(false));
    let _ = catch_unwind(|| crate::hub::after_fork(false));
    let _ = catch_unwind(crate::pair::after_fork);
    let _ = catch_unwind(table::unlock_after_fork);
    crate::epoll::after_fork();
}

extern "C" fn in_child() {
    // This child was seen: the fork watch need not report it.
    fork_watch_reset();
    let _ = catch_unwind(|| crate::vault::after_fork(true));
    let _ = catch_unwind(|| crate::hub::after_fork(true));
    let _ = catch_unwind(crate::pair::after_fork);
    let _ = catch_unwind(table::unlock_after_fork);
    conn::after_fork_child();
    udp::after_fork_child();
    remote::after_fork_child();
    crate::epoll::after_fork();
}

extern "C" fn at_exit() {
    // This process no longer receives (senders go back to the kernel unless another
    // process holds the socket) nor sends.
    let _ = catch_unwind(|| table::all_udp().iter().for_each(|u| u.release()));
    let _ = catch_unwind(remote::at_exit);
}

/// A page (`MADV_WIPEONFORK`, Linux 4.14) the kernel zeroes in every new process
/// made without sharing memory
/// (`fork`, raw `clone` and `clone3`): a zero there means this process was made
/// since the library last looked, whether or not fork handlers ran (a raw `clone`
/// runs none).
static FORK_WATCH: std::sync::atomic::AtomicPtr<std::sync::atomic::AtomicU64> =
    std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// Processes noticed by the fork watch (made without fork handlers).
pub(crate) static UNSEEN_FORKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn watch_forks() {
    // SAFETY: a fresh private anonymous page; the advice only affects it.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return;
        }
        if libc::madvise(p, 4096, libc::MADV_WIPEONFORK) != 0 {
            libc::munmap(p, 4096);
            return;
        }
        let w = p.cast::<std::sync::atomic::AtomicU64>();
        (*w).store(1, Ordering::Relaxed);
        FORK_WATCH.store(w, Ordering::Release);
    }
}

fn fork_watch_reset() {
    let w = FORK_WATCH.load(Ordering::Acquire);
    if !w.is_null() {
        // SAFETY: the watch page, mapped for the life of the process.
        unsafe { (*w).store(1, Ordering::Relaxed) };
    }
}

/// Notices a process made without fork handlers (a raw `clone`) at its first
/// library call: it holds every connection its parent held (the kernel copied the
/// descriptors), so it takes the holds the handlers would have taken, and forgets
/// the parent's cached process id. One load when nothing happened.
#[inline]
pub(crate) fn check_new_process() {
    let w = FORK_WATCH.load(Ordering::Relaxed);
    // SAFETY: the watch page, mapped for the life of the process.
    if w.is_null() || unsafe { (*w).load(Ordering::Relaxed) } != 0 {
        return;
    }
    new_process_seen();
}

/// The fork watch found this process new: take the holds the fork handlers would
/// have taken.
#[cold]
fn new_process_seen() {
    fork_watch_reset();
    for c in table::all_conns() {
        c.add_holder();
    }
    for u in crate::table::all_udp() {
        u.add_holder();
    }
    conn::after_fork_child();
    udp::after_fork_child();
    remote::after_fork_child();
    crate::vault::after_raw_clone();
    crate::pair::after_raw_clone();
    crate::epoll::after_fork();
    UNSEEN_FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Starts watching for new processes and registers the fork and exit handlers.
pub fn start() {
    watch_forks();
    // SAFETY: registers plain extern "C" functions (they take and release library
    // locks and touch atomics; nothing that could fail half-way).
    unsafe { libc::pthread_atfork(Some(before_fork), Some(in_parent), Some(in_child)) };
    // SAFETY: registers a plain extern "C" function (before the statistics line, so
    // it runs after it).
    unsafe { libc::atexit(at_exit) };
}
