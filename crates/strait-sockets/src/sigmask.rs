//! Signals held off while the library does, in the program's place, what the
//! kernel would do inside one system call (a wait that spins before it sleeps): a
//! signal that comes meanwhile stays pending and is let through by the sleep's own
//! mask (`epoll_pwait`, `ppoll`), so the call still ends with EINTR as the
//! kernel's would, instead of the handler running during the spin and the sleep
//! then waiting for an event that the handler's flag was meant to replace.

use crate::real;

/// The thread's signal mask from before [`block_all`], restored on drop.
pub(crate) struct Unblocked {
    mask: libc::sigset_t,
}

impl Unblocked {
    /// The saved mask, for a sleep that lets signals through (`epoll_pwait`).
    pub(crate) fn as_ptr(&self) -> *const libc::sigset_t {
        &self.mask
    }
}

/// Blocks every signal the C library lets a program block (its own internal ones
/// stay deliverable: `setxid` of a threaded program keeps working) and returns the
/// mask to restore; `None` if the mask could not be changed (then nothing changed).
pub(crate) fn block_all() -> Option<Unblocked> {
    let errno = real::errno();
    // SAFETY: sigset_t is plain old data; sigfillset initializes it.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: local sets; pthread_sigmask changes only this thread's mask.
    let r = unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old)
    };
    real::set_errno(errno);
    (r == 0).then_some(Unblocked { mask: old })
}

impl Unblocked {
    /// True if a signal that the saved mask lets through is pending (it came while
    /// blocked: the spin should end and let the sleep deliver it). A system call:
    /// callers ask now and then, not on every turn.
    pub(crate) fn signal_waits(&self) -> bool {
        // SAFETY: sigset_t is plain old data; sigpending fills it.
        let mut pending: libc::sigset_t = unsafe { std::mem::zeroed() };
        let errno = real::errno();
        // SAFETY: a local set.
        let r = unsafe { libc::sigpending(&mut pending) };
        real::set_errno(errno);
        if r != 0 {
            return false;
        }
        // SAFETY: both sets are initialized; sigismember only reads them.
        (1..=libc::SIGRTMAX()).any(|sig| unsafe {
            libc::sigismember(&pending, sig) == 1 && libc::sigismember(&self.mask, sig) == 0
        })
    }
}

impl Drop for Unblocked {
    fn drop(&mut self) {
        let errno = real::errno();
        // SAFETY: restores the mask saved by `block_all` on this thread.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.mask, std::ptr::null_mut()) };
        real::set_errno(errno);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A signal raised while blocked is not run; it is run when the saved mask
    /// comes back, and the mask is then as it was.
    #[test]
    fn a_signal_waits_until_the_mask_comes_back() {
        static RAN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        extern "C" fn on(_: libc::c_int) {
            RAN.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        // SAFETY: a handler that only stores to an atomic; SIGUSR2 is this test's.
        unsafe { libc::signal(libc::SIGUSR2, on as *const () as libc::sighandler_t) };
        let g = block_all().expect("mask");
        // SAFETY: to this thread.
        unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGUSR2) };
        assert!(!RAN.load(std::sync::atomic::Ordering::SeqCst), "ran while blocked");
        // SAFETY: reads the saved mask.
        assert_eq!(unsafe { libc::sigismember(g.as_ptr(), libc::SIGUSR2) }, 0, "saved mask has it unblocked");
        assert!(g.signal_waits(), "pending and let through by the saved mask");
        drop(g);
        assert!(RAN.load(std::sync::atomic::Ordering::SeqCst), "ran once the mask came back");
        assert!(!block_all().expect("mask").signal_waits(), "nothing pending any more");
    }
}
