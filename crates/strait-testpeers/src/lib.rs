//! What the test peers share: helpers that both the TCP and the UDP peer use.

extern "C" fn on_alarm(_: libc::c_int) {}

/// SIGALRM in 100 ms, to a handler that does nothing, with or without SA_RESTART:
/// a blocked call that is waiting then is interrupted (EINTR) or restarted.
pub fn alarm_in_100ms(restart: bool) {
    // SAFETY: installs a handler that does nothing and arms a one-shot timer.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_alarm as *const () as libc::sighandler_t;
        sa.sa_flags = if restart { libc::SA_RESTART } else { 0 };
        assert_eq!(libc::sigaction(libc::SIGALRM, &sa, std::ptr::null_mut()), 0);
        let t = libc::itimerval {
            it_interval: libc::timeval { tv_sec: 0, tv_usec: 0 },
            it_value: libc::timeval { tv_sec: 0, tv_usec: 100_000 },
        };
        assert_eq!(libc::setitimer(libc::ITIMER_REAL, &t, std::ptr::null_mut()), 0);
    }
}
