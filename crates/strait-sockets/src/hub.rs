//! One epoll instance per thread for the bells of process pairs (`pair.rs`):
//! a thread that blocks in a call (or in the `poll` shim) waits on it, beside the
//! descriptors it polls, instead of on a per-connection eventfd.
//!
//! A pair's bell is never read: it is registered here edge-triggered once per
//! thread, so each ring is one event for this thread's instance and for every
//! other waiter's own. The instance itself is pollable (readable while it holds an
//! event), so a sleeper polls it with the rest; [`settle`] then consumes the
//! events, or the instance would stay readable.
//!
//! A forked child gets an instance of its own at its first wait (the inherited one
//! is the parent's: consuming its events would take the parent's wake-ups).
//!
//! **Under a seccomp filter** (a sandboxed child such as OpenSSH's
//! pre-authentication process, whose filter kills a process that calls
//! `epoll_create1` or `epoll_wait`), no instance is made: the thread polls the
//! pair's bell itself, level-triggered, and reads it after a wake-up ([`watch`]
//! answers `None`). Such a child is single-threaded and waits on one connection;
//! a wake-up its read takes from another waiter of the pair is caught by that
//! waiter's bounded poll (100 ms).

use std::cell::RefCell;
use std::sync::Mutex;

use libc::c_int;

use crate::real;

struct Hub {
    /// -1: none may be made here (a seccomp filter).
    epfd: c_int,
    pid: libc::pid_t,
    /// The bells registered (each once).
    bells: Vec<c_int>,
}

/// True if a seccomp filter may refuse this process epoll (asked once per hub:
/// `Seccomp:` in `/proc/self/status`; a status that cannot be read, as where the
/// filter refuses `openat`, counts as filtered).
fn filtered() -> bool {
    let Some(status) = strait_sys::procfs::read("self/status", 1 << 16) else { return true };
    let status = String::from_utf8_lossy(&status);
    status.lines().find_map(|l| l.strip_prefix("Seccomp:")).is_none_or(|v| v.trim() != "0")
}

thread_local! {
    static HUB: RefCell<Option<Hub>> = const { RefCell::new(None) };
}

/// Every live hub of this process, with the bells it watches: a pair that goes
/// away takes its bell out of each ([`forget`]), as the kernel would keep the
/// registration while the peer holds the eventfd, under a number that may be given
/// to another file.
static ALL: Mutex<Hubs> = Mutex::new(Vec::new());

/// Each hub's instance with the bells registered in it.
type Hubs = Vec<(c_int, Vec<c_int>)>;

fn all() -> std::sync::MutexGuard<'static, Hubs> {
    ALL.lock().unwrap_or_else(|e| e.into_inner())
}

fn current_pid() -> libc::pid_t {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

/// This thread's instance, with `bell` registered in it (edge-triggered, once);
/// `None` if none may be made (see the module doc: poll the bell itself then).
pub(crate) fn watch(bell: c_int) -> Option<c_int> {
    HUB.with(|h| {
        let mut h = h.borrow_mut();
        let pid = current_pid();
        if h.as_ref().is_some_and(|x| x.pid != pid) {
            // Inherited over a fork: the parent's instance. Ours is made below;
            // the parent's stays open in the parent only.
            if let Some(old) = h.take().filter(|o| o.epfd >= 0) {
                crate::fds::let_go(&[old.epfd]);
            }
        }
        if h.is_none() {
            let epfd = if filtered() {
                -1
            } else {
                // SAFETY: plain syscall.
                match unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) } {
                    e if e >= 0 => crate::fds::keep(e),
                    e => e,
                }
            };
            if epfd >= 0 {
                all().push((epfd, Vec::new()));
            }
            *h = Some(Hub { epfd, pid, bells: Vec::new() });
        }
        let hub = h.as_mut()?;
        if hub.epfd < 0 {
            return None;
        }
        if !hub.bells.contains(&bell) {
            let mut e =
                libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: bell as u64 };
            // SAFETY: a local epoll_event; `bell` is a pair's eventfd.
            if unsafe { real::epoll_ctl(hub.epfd, libc::EPOLL_CTL_ADD, bell, &mut e) } == 0
                || real::errno() == libc::EEXIST
            {
                hub.bells.push(bell);
                if let Some(x) = all().iter_mut().find(|x| x.0 == hub.epfd) {
                    x.1.push(bell);
                }
            }
        }
        Some(hub.epfd)
    })
}

/// True if `fd` is this thread's instance (not a pair's bell polled directly).
pub(crate) fn is_mine(fd: c_int) -> bool {
    fd >= 0 && HUB.with(|h| h.borrow().as_ref().is_some_and(|x| x.epfd == fd))
}

/// Consumes the events of this thread's instance `epfd` (after a poll found it
/// readable), without waiting.
pub(crate) fn settle(epfd: c_int) {
    let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 16];
    // Edge-triggered: one call takes every event there is, up to 16 bells at once;
    // more (rare) come back at the next wait.
    // SAFETY: a local array of 16 events.
    unsafe { real::epoll_wait(epfd, ev.as_mut_ptr(), ev.len() as c_int, 0) };
}

/// A pair's bell is going away: out of every hub of this process.
pub(crate) fn forget(bell: c_int) {
    for (epfd, bells) in all().iter_mut() {
        if let Some(i) = bells.iter().position(|&b| b == bell) {
            bells.swap_remove(i);
            let mut e = libc::epoll_event { events: 0, u64: 0 };
            // SAFETY: a local epoll_event.
            unsafe { real::epoll_ctl(*epfd, libc::EPOLL_CTL_DEL, bell, &mut e) };
        }
    }
    // `try_with`: a pair can be let go while this thread exits (its last holder a
    // closed connection kept in the thread's cache of descriptor-table entries,
    // dropped with the thread's other locals), after this thread's hub is gone.
    let _ = HUB.try_with(|h| {
        if let Ok(mut h) = h.try_borrow_mut() {
            if let Some(hub) = h.as_mut() {
                hub.bells.retain(|&b| b != bell);
            }
        }
    });
}

thread_local! {
    static FORK_GUARD: RefCell<Option<std::sync::MutexGuard<'static, Hubs>>> =
        const { RefCell::new(None) };
}

/// Before a fork: no other thread may hold the hubs' list while the child's copy
/// is made.
pub(crate) fn before_fork() {
    let g = all();
    FORK_GUARD.with(|f| *f.borrow_mut() = Some(g));
}

/// After a fork, in both processes. In the child, every hub listed is one of the
/// parent's instances (consuming its events would take the parent's wake-ups):
/// the child closes its copies and each of its threads makes its own at its next
/// wait.
pub(crate) fn after_fork(child: bool) {
    FORK_GUARD.with(|f| {
        if let Some(mut g) = f.borrow_mut().take() {
            if child {
                let fds: Vec<c_int> = g.iter().map(|x| x.0).collect();
                g.clear();
                HUB.with(|h| *h.borrow_mut() = None);
                crate::fds::let_go(&fds);
            }
        }
    });
}

/// Hubs of this process (one per thread that waited on a pair), for `--stats`.
pub(crate) fn count() -> usize {
    all().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_wakes_the_hub_once_and_settles() {
        // SAFETY: plain syscalls on a fresh eventfd.
        let bell = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        let Some(ep) = watch(bell) else {
            // (Under a seccomp filter, as in some sandboxes: nothing to test.)
            assert!(filtered());
            crate::sock::close_all(&[bell]);
            return;
        };
        assert_eq!(watch(bell), Some(ep), "one instance per thread, the bell once");
        let poll_hub = || {
            let mut p = libc::pollfd { fd: ep, events: libc::POLLIN, revents: 0 };
            // SAFETY: one local pollfd.
            unsafe { libc::poll(&mut p, 1, 0) }
        };
        assert_eq!(poll_hub(), 0);
        crate::sock::ring_eventfd(bell);
        assert_eq!(poll_hub(), 1);
        settle(ep);
        assert_eq!(poll_hub(), 0, "settled, though the count was never read");
        crate::sock::ring_eventfd(bell);
        assert_eq!(poll_hub(), 1, "the next ring is an event again");
        settle(ep);
        forget(bell);
        crate::sock::ring_eventfd(bell);
        assert_eq!(poll_hub(), 0, "a forgotten bell wakes no one");
        crate::sock::close_all(&[bell]);
    }
}
