//! `libstrait_preload.so`: loaded with `LD_PRELOAD` (by `strait run`), it carries TCP
//! connections between two processes that both run under strait on this host over
//! per-connection shared memory, and UDP datagrams between their sockets over
//! per-(sender, receiver) message rings, with no change to either program.
//!
//! This crate is only the C face of the library: every exported function is a shim
//! that forwards its arguments to the function of the same name in
//! [`strait_sockets`] (socket calls in `calls`, exec and spawn in `exec`, stdio in
//! `stdio`), where all the logic lives and is unit-tested. Kept apart because a
//! cdylib's exports would interpose `read`/`write`/... on whatever links an rlib of
//! it.

pub mod probes;

use libc::{
    c_char, c_int, c_uint, c_ulong, c_void, epoll_event, iovec, msghdr, nfds_t, pid_t, pollfd, sigset_t,
    size_t, sockaddr, socklen_t, ssize_t, timespec, FILE,
};
use strait_sockets::{calls, exec, sigmask, stdio};

/// Exports `name` with libc's signature, forwarding to `$module::name`.
macro_rules! shims {
    ($module:ident: $($name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)?;)*) => {$(
        /// # Safety
        #[doc = concat!("As for libc's `", stringify!($name), "`.")]
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) $(-> $ret)? {
            // SAFETY: the caller's arguments, forwarded unchanged to the function
            // that stands for libc's.
            unsafe { $module::$name($($arg),*) }
        }
    )*};
}

shims! { calls:
    connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
    listen(fd: c_int, backlog: c_int) -> c_int;
    accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int;
    accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t;
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    readv(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t;
    recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    __recv_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int) -> ssize_t;
    send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, alen: *mut socklen_t) -> ssize_t;
    __recvfrom_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t, flags: c_int, addr: *mut sockaddr, alen: *mut socklen_t) -> ssize_t;
    sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, alen: socklen_t) -> ssize_t;
    sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, count: size_t) -> ssize_t;
    sendfile64(out: c_int, inp: c_int, off: *mut libc::off_t, count: size_t) -> ssize_t;
    sendmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int) -> c_int;
    recvmmsg(fd: c_int, v: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int, t: *mut timespec) -> c_int;
    splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: libc::c_uint) -> ssize_t;
    close(fd: c_int) -> c_int;
    close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int;
    closefrom(first: c_int);
    shutdown(fd: c_int, how: c_int) -> c_int;
    dup(fd: c_int) -> c_int;
    dup2(fd: c_int, new: c_int) -> c_int;
    dup3(fd: c_int, new: c_int, flags: c_int) -> c_int;
    fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int;
    fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int;
    ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int;
    poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int;
    __poll_chk(fds: *mut pollfd, n: nfds_t, timeout: c_int, fdslen: size_t) -> c_int;
    ppoll(fds: *mut pollfd, n: nfds_t, t: *const timespec, mask: *const sigset_t) -> c_int;
    select(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, t: *mut libc::timeval) -> c_int;
    pselect(n: c_int, r: *mut libc::fd_set, w: *mut libc::fd_set, e: *mut libc::fd_set, t: *const timespec, mask: *const sigset_t) -> c_int;
    epoll_pwait2(ep: c_int, ev: *mut epoll_event, max: c_int, t: *const timespec, mask: *const sigset_t) -> c_int;
    epoll_ctl(ep: c_int, op: c_int, fd: c_int, ev: *mut epoll_event) -> c_int;
    epoll_wait(ep: c_int, ev: *mut epoll_event, max: c_int, timeout: c_int) -> c_int;
    epoll_pwait(ep: c_int, ev: *mut epoll_event, max: c_int, timeout: c_int, mask: *const sigset_t) -> c_int;
}

/// A NULL-terminated array of C strings: an `argv` or an `envp`.
type CStrs = *const *const c_char;

shims! { exec:
    execve(path: *const c_char, argv: CStrs, envp: CStrs) -> c_int;
    execv(path: *const c_char, argv: CStrs) -> c_int;
    execvp(file: *const c_char, argv: CStrs) -> c_int;
    execvpe(file: *const c_char, argv: CStrs, envp: CStrs) -> c_int;
    fexecve(fd: c_int, argv: CStrs, envp: CStrs) -> c_int;
    execveat(dirfd: c_int, path: *const c_char, argv: CStrs, envp: CStrs, flags: c_int) -> c_int;
    posix_spawn(
        pid: *mut pid_t,
        path: *const c_char,
        actions: *const libc::posix_spawn_file_actions_t,
        attr: *const libc::posix_spawnattr_t,
        argv: *const *mut c_char,
        envp: *const *mut c_char
    ) -> c_int;
    posix_spawnp(
        pid: *mut pid_t,
        file: *const c_char,
        actions: *const libc::posix_spawn_file_actions_t,
        attr: *const libc::posix_spawnattr_t,
        argv: *const *mut c_char,
        envp: *const *mut c_char
    ) -> c_int;
    system(line: *const c_char) -> c_int;
    popen(command: *const c_char, mode: *const c_char) -> *mut FILE;
    pclose(f: *mut FILE) -> c_int;
    vfork() -> pid_t;
}

shims! { sigmask:
    sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int;
    signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
    sysv_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
    bsd_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
    sigset(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
}

shims! { stdio:
    fdopen(fd: c_int, mode: *const c_char) -> *mut FILE;
    fileno(f: *mut FILE) -> c_int;
    fileno_unlocked(f: *mut FILE) -> c_int;
}

/// The variadic `execl`, `execlp` and `execle`: stable Rust cannot define a
/// C-variadic function, so each is a naked trampoline that stores the six argument
/// registers next to the caller's stack arguments and calls
/// [`strait_sockets::exec::exec_list`] with both; the integer arguments of a
/// variadic call sit exactly there (System V x86-64 ABI).
#[cfg(target_arch = "x86_64")]
mod variadic {
    use libc::c_int;

    macro_rules! trampoline {
        ($name:ident, $kind:expr) => {
            /// # Safety
            /// As for the libc function of this name.
            #[unsafe(naked)]
            #[no_mangle]
            pub unsafe extern "C" fn $name() -> c_int {
                std::arch::naked_asm!(
                    "push rbp",
                    "mov rbp, rsp",
                    "sub rsp, 48",
                    "mov [rsp], rdi",
                    "mov [rsp + 8], rsi",
                    "mov [rsp + 16], rdx",
                    "mov [rsp + 24], rcx",
                    "mov [rsp + 32], r8",
                    "mov [rsp + 40], r9",
                    "mov rdi, rsp",
                    "lea rsi, [rbp + 16]",
                    "mov edx, {kind}",
                    "call {imp}",
                    "leave",
                    "ret",
                    kind = const $kind,
                    imp = sym strait_sockets::exec::exec_list,
                )
            }
        };
    }

    trampoline!(execl, 0);
    trampoline!(execlp, 1);
    trampoline!(execle, 2);
}

/// Runs when the library is loaded, before the program's `main`.
extern "C" fn init() {
    strait_sockets::init();
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;
