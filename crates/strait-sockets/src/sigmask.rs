//! Signals held off while the library does, in the program's place, what the
//! kernel would do inside one system call (a wait that spins before it sleeps): a
//! signal that comes meanwhile stays pending and is let through by the sleep's own
//! mask (`epoll_pwait`, `ppoll`), so the call still ends with EINTR as the
//! kernel's would, instead of the handler running during the spin and the sleep
//! then waiting for an event that the handler's flag was meant to replace.
//!
//! Holding costs two system calls per wait, so a blocked read or receive holds
//! only when the program has a handler that could end it ([`handlers`]: a scan of
//! the actions, kept until the program changes one through libc, whose functions
//! for that the preload exports from here).

use crate::real;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

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

/// What the program's signal handlers would make of a blocked socket call that a
/// signal interrupts (the kernel's rules, signal(7)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handlers {
    /// Some asynchronous signal has a handler: it ends a call that has a timeout
    /// (`SO_RCVTIMEO`/`SO_SNDTIMEO`), `SA_RESTART` or not, and `epoll_wait`.
    pub(crate) any: bool,
    /// Some asynchronous signal has a handler without `SA_RESTART`: it ends any
    /// blocked call with EINTR.
    pub(crate) interrupting: bool,
}

/// Bumped by every change of a handler ([`handlers_changed`]).
static HANDLERS_GENERATION: AtomicU32 = AtomicU32::new(1);
/// The last scan: its generation in the high 32 bits, `any` in bit 0 and
/// `interrupting` in bit 1. Generation 0: never scanned.
static HANDLERS_SCAN: AtomicU64 = AtomicU64::new(0);

/// The program's handlers, from a scan kept until a handler changes (the
/// library's `sigaction`, `signal`, `sysv_signal`, `bsd_signal` and `sigset` say
/// so). A scan is one `sigaction` query per signal: a blocked call asks this
/// before it spins, so it must not scan each time. A handler installed by a raw
/// `rt_sigaction` system call is not seen until the next change through libc.
pub(crate) fn handlers() -> Handlers {
    let generation = HANDLERS_GENERATION.load(Ordering::Acquire);
    let scan = HANDLERS_SCAN.load(Ordering::Acquire);
    if (scan >> 32) as u32 == generation {
        return Handlers { any: scan & 1 != 0, interrupting: scan & 2 != 0 };
    }
    let h = scan_handlers();
    // Kept only if no handler changed during the scan (else the next call scans).
    if HANDLERS_GENERATION.load(Ordering::Acquire) == generation {
        let bits = (h.any as u64) | (h.interrupting as u64) << 1;
        HANDLERS_SCAN.store((generation as u64) << 32 | bits, Ordering::Release);
    }
    h
}

/// Says that a handler may have changed: the next [`handlers`] scans again.
pub fn handlers_changed() {
    HANDLERS_GENERATION.fetch_add(1, Ordering::AcqRel);
}

// The C library's ways to change a handler, exported by the preload: each is the
// real one, then [`handlers_changed`]. (`signal` and the others reach the kernel
// through libc's internal `sigaction`, which the preload's does not see.)

/// libc's `sigaction`; a change (a non-null `act`) is noted for [`handlers`].
///
/// # Safety
/// As for libc's `sigaction`.
pub unsafe fn sigaction(
    sig: libc::c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> libc::c_int {
    // SAFETY: the caller's arguments, forwarded.
    let r = unsafe { real::sigaction(sig, act, old) };
    if !act.is_null() {
        handlers_changed();
    }
    r
}

macro_rules! handler_setters {
    ($($name:ident),*) => {$(
        #[doc = concat!("libc's `", stringify!($name), "`, noted for [`handlers`].")]
        ///
        /// # Safety
        #[doc = concat!("As for libc's `", stringify!($name), "`.")]
        pub unsafe fn $name(sig: libc::c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
            // SAFETY: the caller's arguments, forwarded.
            let r = unsafe { real::$name(sig, handler) };
            handlers_changed();
            r
        }
    )*};
}

handler_setters!(signal, sysv_signal, bsd_signal, sigset);

/// Asks the kernel for every asynchronous signal's action.
fn scan_handlers() -> Handlers {
    let errno = real::errno();
    let mut h = Handlers { any: false, interrupting: false };
    for sig in 1..=libc::SIGRTMAX() {
        // Fault signals are synchronous: they never interrupt a blocked call (and
        // runtimes such as Rust's install handlers for them without SA_RESTART).
        if [
            libc::SIGKILL,
            libc::SIGSTOP,
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGILL,
            libc::SIGFPE,
            libc::SIGTRAP,
        ]
        .contains(&sig)
        {
            continue;
        }
        // SAFETY: sigaction is plain old data; a query with a null new action.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { real::sigaction(sig, std::ptr::null(), &mut old) } == 0
            && old.sa_sigaction != libc::SIG_DFL
            && old.sa_sigaction != libc::SIG_IGN
        {
            h.any = true;
            if old.sa_flags & libc::SA_RESTART == 0 {
                h.interrupting = true;
                break;
            }
        }
    }
    real::set_errno(errno);
    h
}

/// How long a blocked call spins before it holds signals. Holding costs two
/// system calls (~0.13 us here, half a 16-byte ping-pong's 0.26 us), so the short
/// waits of a busy exchange do not hold. A handler that runs in these first
/// microseconds of a wait is followed by more waiting, as with SA_RESTART: the one
/// window left where the call does not end with EINTR as the kernel's would.
pub(crate) const HOLD_AFTER: std::time::Duration = std::time::Duration::from_micros(2);

/// Signals held for a blocked call's spin, when the program has a handler that
/// could end the call: a handler run during the spin would be followed by more
/// waiting where the kernel's call would have returned EINTR. The spin then asks
/// [`Unblocked::signal_waits`] now and then, and the sleep lets signals through
/// with the saved mask (`ppoll`). `None`: nothing to hold, or it could not be.
fn hold_for_wait() -> Option<Unblocked> {
    if handlers().any {
        block_all()
    } else {
        None
    }
}

/// The signals of one blocked read or receive: held from [`HOLD_AFTER`] into its
/// spin on (if a handler could end it), and for its sleeps; the mask comes back
/// when this is dropped.
#[derive(Default)]
pub(crate) struct WaitSignals {
    /// `None`: not decided yet (the spin is young); `Some(None)`: nothing held.
    held: Option<Option<Unblocked>>,
}

impl WaitSignals {
    /// At a look at the clock of the spin, `waited` into it: holds once the spin
    /// is past its first microseconds.
    pub(crate) fn spun(&mut self, waited: std::time::Duration) {
        if self.held.is_none() && waited >= HOLD_AFTER {
            self.held = Some(hold_for_wait());
        }
    }

    /// True if a signal held came meanwhile (a system call: now and then): the spin
    /// should end and let the sleep deliver it.
    pub(crate) fn signal_waits(&self) -> bool {
        self.held.as_ref().and_then(Option::as_ref).is_some_and(Unblocked::signal_waits)
    }

    /// For the sleeps: holds now if the spin did not, and gives the mask to sleep
    /// with (`None`: nothing held).
    pub(crate) fn sleep_mask(&mut self) -> Option<*const libc::sigset_t> {
        self.held.get_or_insert_with(hold_for_wait).as_ref().map(Unblocked::as_ptr)
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

    /// A handler installed through the library's `sigaction` is seen by the next
    /// [`handlers`], with or without SA_RESTART, and so is its removal (the scan is
    /// kept between changes, not stale after one).
    #[test]
    fn a_changed_handler_is_seen_by_the_next_look() {
        extern "C" fn on(_: libc::c_int) {}
        let install = |flags: libc::c_int, handler: libc::sighandler_t| {
            // SAFETY: sigaction is plain old data; SIGUSR1 is this test's.
            let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
            sa.sa_sigaction = handler;
            sa.sa_flags = flags;
            // SAFETY: a local action.
            assert_eq!(unsafe { sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()) }, 0);
        };
        let _ = handlers();
        install(0, on as *const () as libc::sighandler_t);
        assert!(handlers().any && handlers().interrupting, "a handler without SA_RESTART");
        install(libc::SA_RESTART, on as *const () as libc::sighandler_t);
        assert!(handlers().any && !handlers().interrupting, "the same handler with SA_RESTART");
        install(0, on as *const () as libc::sighandler_t);
        assert!(handlers().interrupting);
        // SAFETY: back to the default action.
        unsafe { signal(libc::SIGUSR1, libc::SIG_DFL) };
        assert!(!handlers().interrupting, "the default action again");
    }
}
