//! How a blocked call waits: deadlines cut into slices, the kernel's own poll (the
//! real one, never the interposed), and what a signal or a socket timeout means for
//! a wait the library does in the program's place.

use std::time::{Duration, Instant};

use libc::{c_int, nfds_t, pollfd, sigset_t};

use crate::real;

/// Longest single sleep: a safety net against a wake-up taken by another thread
/// waiting on the same connection.
pub(crate) const SLICE: Duration = Duration::from_millis(1000);

pub(crate) fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// The exact sleep before a deadline: what is left of it (at most [`SLICE`]), or
/// less if the earliest of `attach` deadlines comes first (a pending connector
/// decides for the kernel then, and its program must hear it). Not rounded up to
/// a millisecond: a wait that spun first and then slept the rest rounded up ended
/// up to a millisecond late, and an event loop's timers with it.
pub(crate) fn slice_left(deadline: Option<Instant>, attach: impl Iterator<Item = Instant>) -> Duration {
    let now = Instant::now();
    let mut d = deadline.map_or(SLICE, |d| d.saturating_duration_since(now).min(SLICE));
    if let Some(a) = attach.min() {
        d = d.min(a.saturating_duration_since(now));
    }
    d
}

/// The duration as a `timespec`.
pub(crate) fn timespec(d: Duration) -> libc::timespec {
    libc::timespec { tv_sec: d.as_secs() as _, tv_nsec: d.subsec_nanos() as _ }
}

/// [`kernel_poll`] for exactly `d` (`ppoll` with a `timespec`); a whole number of
/// milliseconds, or a set the descriptor limit refuses, as [`kernel_poll`].
pub(crate) fn kernel_poll_for(fds: &mut [pollfd], d: Duration, mask: Option<*const sigset_t>) -> c_int {
    let ms = c_int::try_from(d.as_micros().div_ceil(1000)).unwrap_or(c_int::MAX);
    if d.subsec_nanos().is_multiple_of(1_000_000) {
        return kernel_poll(fds, ms, mask);
    }
    let ts = timespec(d);
    // SAFETY: a slice of pollfds and its length; the mask is the caller's or null.
    let r =
        unsafe { real::ppoll(fds.as_mut_ptr(), fds.len() as nfds_t, &ts, mask.unwrap_or(std::ptr::null())) };
    // (EINVAL: more descriptors than the limit; EPERM, ENOSYS: a seccomp filter
    // that allows `poll` only.)
    if r >= 0 || !matches!(real::errno(), libc::EINVAL | libc::EPERM | libc::ENOSYS) {
        return r;
    }
    kernel_poll(fds, ms, mask)
}

/// The kernel's `poll` (or `ppoll` with `mask`) over `fds` for at most `ms`
/// milliseconds, within the process's descriptor limit. The kernel refuses a set
/// longer than `RLIMIT_NOFILE` (EINVAL), and the library adds its own descriptors
/// to the program's: a sandboxed process that lowered the limit (OpenSSH's
/// pre-authentication child sets it to 1) would see every wait fail. Then the
/// entries that name a descriptor are polled without waiting, in pieces the limit
/// allows (one at a time), and the call waits at most a millisecond before it
/// answers 0 (callers wait in slices and come back).
pub(crate) fn kernel_poll(fds: &mut [pollfd], ms: c_int, mask: Option<*const sigset_t>) -> c_int {
    // SAFETY: a slice of pollfds and its length; the mask is the caller's.
    let r = unsafe {
        match mask {
            None => real::poll(fds.as_mut_ptr(), fds.len() as nfds_t, ms),
            Some(m) => {
                let ts = libc::timespec {
                    tv_sec: (ms / 1000) as _,
                    tv_nsec: ((ms % 1000) as i64 * 1_000_000) as _,
                };
                real::ppoll(fds.as_mut_ptr(), fds.len() as nfds_t, &ts, m)
            }
        }
    };
    if r >= 0 || real::errno() != libc::EINVAL {
        return r;
    }
    // One descriptor at a time is within any limit but 0 (asking the limit is a
    // system call a sandbox may forbid: OpenSSH's kills the process for it).
    let live: Vec<usize> = (0..fds.len()).filter(|&i| fds[i].fd >= 0).collect();
    let mut ready = 0;
    for &i in &live {
        let mut one = [fds[i]];
        // SAFETY: one pollfd, no waiting.
        if unsafe { real::poll(one.as_mut_ptr(), 1, 0) } < 0 {
            return -1;
        }
        fds[i].revents = one[0].revents;
        ready += (one[0].revents != 0) as c_int;
    }
    if ready == 0 && ms != 0 {
        // Wait a millisecond at most on the first descriptor (the library puts a
        // doorbell first where it sleeps), then answer: callers come back.
        if let Some(&i) = live.first() {
            let mut one = [fds[i]];
            // (With the caller's mask: a signal it holds is let through here.)
            let ts = libc::timespec { tv_sec: 0, tv_nsec: 1_000_000 };
            // SAFETY: one pollfd; the mask is the caller's or null.
            let r = unsafe { real::ppoll(one.as_mut_ptr(), 1, &ts, mask.unwrap_or(std::ptr::null())) };
            if r < 0 {
                return -1;
            }
            if r > 0 {
                fds[i].revents = one[0].revents;
                ready = 1;
            }
        }
    }
    ready
}

/// A spin budget above which a blocked call looks up its socket's timeout before it
/// spins: a timer's own slack (50 us for a sleeping thread), so that a shorter spin
/// may overrun a timeout by no more than the kernel's sleep would, and the look-up
/// (a system call) is made only where the spin is long enough to hide it.
const TIMEOUT_SLACK: Duration = Duration::from_micros(50);

/// The timeout that bounds a blocked call's wait, for `SO_RCVTIMEO` or
/// `SO_SNDTIMEO` (`opt`) of `fd`: the spin `budget` cut to it, and, once asked for,
/// the deadline counted from `start` (the call's start, as the kernel counts it).
pub(crate) struct CallTimeout {
    fd: c_int,
    opt: c_int,
    start: Instant,
    looked: Option<Option<Duration>>,
}

impl CallTimeout {
    /// For a wait that began at `start` and may spin `budget`; returns the budget
    /// cut to the socket's timeout (looked up only if the budget is long).
    pub(crate) fn new(fd: c_int, opt: c_int, start: Instant, budget: Duration) -> (CallTimeout, Duration) {
        let mut t = CallTimeout { fd, opt, start, looked: None };
        if budget <= TIMEOUT_SLACK {
            return (t, budget);
        }
        let timeout = sock_timeout(fd, opt);
        t.looked = Some(timeout);
        (t, timeout.map_or(budget, |d| budget.min(d)))
    }

    /// When the wait must end, if the socket has a timeout.
    pub(crate) fn deadline(&mut self) -> Option<Instant> {
        let (fd, opt) = (self.fd, self.opt);
        self.looked.get_or_insert_with(|| sock_timeout(fd, opt)).map(|d| self.start + d)
    }
}

/// The socket's SO_RCVTIMEO/SO_SNDTIMEO, if set.
pub(crate) fn sock_timeout(fd: c_int, opt: c_int) -> Option<Duration> {
    let mut tv = libc::timeval { tv_sec: 0, tv_usec: 0 };
    let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: a local timeval and its length.
    let r = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, opt, (&mut tv as *mut libc::timeval).cast(), &mut len)
    };
    if r != 0 || (tv.tv_sec == 0 && tv.tv_usec == 0) {
        return None;
    }
    Some(Duration::from_secs(tv.tv_sec.max(0) as u64) + Duration::from_micros(tv.tv_usec.max(0) as u64))
}

/// After a wait was interrupted by a signal: restart it (as SA_RESTART would) only if
/// every installed handler has SA_RESTART and the socket has no timeout for this
/// direction (a socket call with `SO_RCVTIMEO`/`SO_SNDTIMEO` is never restarted,
/// signal(7)). We cannot tell which signal it was, so a program with any
/// non-restarting handler sees EINTR, as it would for that signal.
pub(crate) fn signal_restarts(timeout_set: bool) -> bool {
    !timeout_set && !crate::sigmask::handlers().interrupting
}
