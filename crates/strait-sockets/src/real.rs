//! The real libc functions behind the ones this library exports, found once with
//! `dlsym(RTLD_NEXT, ...)`.
//!
//! Inside this library every call to a function that it also exports must go through
//! here: a plain `libc::read` would bind to our own `read`.

use libc::{
    c_char, pid_t, posix_spawn_file_actions_t, posix_spawnattr_t, sockaddr, socklen_t, ssize_t, timespec,
};
use libc::{c_int, c_uint, c_ulong, c_void, epoll_event, iovec, msghdr, nfds_t, pollfd, sigset_t, size_t};
use std::sync::atomic::{AtomicUsize, Ordering};

fn resolve(name: &'static str) -> usize {
    // SAFETY: `name` is a NUL-terminated literal (the macro appends "\0").
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) };
    if p.is_null() {
        // Without the real function we cannot do anything sensible; glibc always has
        // these, so this only happens under a libc we were never meant to run with.
        let msg = b"strait-preload: a libc function is missing, aborting\n";
        // SAFETY: raw write of a static buffer to stderr.
        unsafe {
            libc::syscall(libc::SYS_write, 2, msg.as_ptr(), msg.len());
            libc::abort();
        }
    }
    p as usize
}

/// The address of libc's `name` (NUL-terminated), looked up on the first call and
/// kept in `slot`.
#[inline]
fn cached(slot: &AtomicUsize, name: &'static str) -> usize {
    let mut p = slot.load(Ordering::Relaxed);
    if p == 0 {
        p = resolve(name);
        slot.store(p, Ordering::Relaxed);
    }
    p
}

macro_rules! reals {
    ($( fn $name:ident($($a:ident: $t:ty),*) -> $r:ty; )*) => {$(
        /// The real libc function of this name.
        ///
        /// # Safety
        /// As for the libc function.
        #[inline]
        pub unsafe fn $name($($a: $t),*) -> $r {
            static P: AtomicUsize = AtomicUsize::new(0);
            let p = cached(&P, concat!(stringify!($name), "\0"));
            // SAFETY: `p` is the address of the libc function of this name, whose C
            // prototype is the one spelled here.
            let f: unsafe extern "C" fn($($t),*) -> $r = unsafe { std::mem::transmute::<usize, _>(p) };
            // SAFETY: forwarded contract.
            unsafe { f($($a),*) }
        }
    )*};
}

reals! {
    fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    fn setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    fn listen(fd: c_int, backlog: c_int) -> c_int;
    fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    fn readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    fn sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, a: *const sockaddr, l: socklen_t) -> ssize_t;
    fn recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, a: *mut sockaddr, l: *mut socklen_t) -> ssize_t;
    fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    fn close(fd: c_int) -> c_int;
    fn shutdown(fd: c_int, how: c_int) -> c_int;
    fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int;
    fn ppoll(fds: *mut pollfd, n: nfds_t, t: *const timespec, mask: *const sigset_t) -> c_int;
    fn select(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, t: *mut libc::timeval) -> c_int;
    fn epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int;
    fn epoll_wait(ep: c_int, ev: *mut epoll_event, max: c_int, timeout: c_int) -> c_int;
    fn epoll_pwait(ep: c_int, ev: *mut epoll_event, max: c_int, timeout: c_int, mask: *const sigset_t) -> c_int;
    fn dup(fd: c_int) -> c_int;
    fn dup2(fd: c_int, new: c_int) -> c_int;
    fn dup3(fd: c_int, new: c_int, flags: c_int) -> c_int;
    fn sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, n: size_t) -> ssize_t;
    fn sendmmsg(fd: c_int, v: *mut libc::mmsghdr, n: c_uint, flags: c_int) -> c_int;
    fn recvmmsg(fd: c_int, v: *mut libc::mmsghdr, n: c_uint, flags: c_int, t: *mut timespec) -> c_int;
    fn splice(i: c_int, oi: *mut libc::loff_t, o: c_int, oo: *mut libc::loff_t, n: size_t, f: c_uint) -> ssize_t;
    fn pselect(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, t: *const timespec, m: *const sigset_t) -> c_int;
    fn epoll_pwait2(ep: c_int, ev: *mut epoll_event, max: c_int, t: *const timespec, mask: *const sigset_t) -> c_int;
    fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fn execveat(dirfd: c_int, path: *const c_char, argv: *const *const c_char, envp: *const *const c_char, flags: c_int) -> c_int;
    fn posix_spawn(pid: *mut pid_t, path: *const c_char, fa: *const posix_spawn_file_actions_t, at: *const posix_spawnattr_t, argv: *const *mut c_char, envp: *const *mut c_char) -> c_int;
    fn fdopen(fd: c_int, mode: *const c_char) -> *mut libc::FILE;
    fn fileno(f: *mut libc::FILE) -> c_int;
    fn fileno_unlocked(f: *mut libc::FILE) -> c_int;
    fn posix_spawnp(pid: *mut pid_t, file: *const c_char, fa: *const posix_spawn_file_actions_t, at: *const posix_spawnattr_t, argv: *const *mut c_char, envp: *const *mut c_char) -> c_int;
    fn system(line: *const c_char) -> c_int;
    fn popen(command: *const c_char, mode: *const c_char) -> *mut libc::FILE;
    fn pclose(f: *mut libc::FILE) -> c_int;
    fn sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int;
    fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
    fn sysv_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
    fn bsd_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
    fn sigset(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
}

/// The real `fcntl` (variadic in C; the third argument is an int or a pointer).
///
/// # Safety
/// As for `fcntl`.
pub unsafe fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    static P: AtomicUsize = AtomicUsize::new(0);
    let p = cached(&P, "fcntl\0");
    // SAFETY: `p` is libc's variadic fcntl.
    let f: unsafe extern "C" fn(c_int, c_int, ...) -> c_int = unsafe { std::mem::transmute::<usize, _>(p) };
    // SAFETY: forwarded contract.
    unsafe { f(fd, cmd, arg) }
}

/// The real `ioctl` (variadic in C).
///
/// # Safety
/// As for `ioctl`.
pub unsafe fn ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int {
    static P: AtomicUsize = AtomicUsize::new(0);
    let p = cached(&P, "ioctl\0");
    // SAFETY: `p` is libc's variadic ioctl.
    let f: unsafe extern "C" fn(c_int, c_ulong, ...) -> c_int = unsafe { std::mem::transmute::<usize, _>(p) };
    // SAFETY: forwarded contract.
    unsafe { f(fd, req, arg) }
}

/// Sets `errno`.
pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// Reads `errno`.
pub fn errno() -> c_int {
    // SAFETY: as above.
    unsafe { *libc::__errno_location() }
}

/// `-1` with `errno = e`, as an `ssize_t`.
pub fn fail(e: c_int) -> ssize_t {
    set_errno(e);
    -1
}
