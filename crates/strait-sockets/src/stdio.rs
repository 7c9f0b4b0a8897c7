//! Standard I/O streams on accelerated sockets.
//!
//! glibc's `FILE` functions read and write through libc-internal entry points that
//! no preload library can interpose, so a stream over an accelerated socket would
//! meet the idle kernel socket: its output would never arrive and its input would
//! wait for ever. A stream over an accelerated socket is therefore a `fopencookie`
//! stream whose reads and writes go through this library's `read`/`write`: `fdopen`
//! of an accelerated socket returns one, and a program started by `exec` whose
//! standard input, output or error is an inherited accelerated socket (the inetd
//! pattern) gets one as `stdin`/`stdout`/`stderr` before its `main` runs. `fileno`
//! answers the socket's descriptor for them, as for any stream.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use libc::{c_char, c_int, c_void, size_t, ssize_t, FILE};

use crate::real;

/// Our streams: (stream, descriptor).
static STREAMS: Mutex<Vec<(usize, c_int)>> = Mutex::new(Vec::new());
/// How many there are (`fileno` of any other stream then costs one load).
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// glibc's `cookie_io_functions_t` (not in the `libc` crate).
#[repr(C)]
struct CookieIoFunctions {
    read: Option<extern "C" fn(*mut c_void, *mut c_char, size_t) -> ssize_t>,
    write: Option<extern "C" fn(*mut c_void, *const c_char, size_t) -> ssize_t>,
    seek: Option<extern "C" fn(*mut c_void, *mut i64, c_int) -> c_int>,
    close: Option<extern "C" fn(*mut c_void) -> c_int>,
}

extern "C" {
    fn fopencookie(cookie: *mut c_void, mode: *const c_char, funcs: CookieIoFunctions) -> *mut FILE;
    static mut stdin: *mut FILE;
    static mut stdout: *mut FILE;
    static mut stderr: *mut FILE;
}

fn fd_of(cookie: *mut c_void) -> c_int {
    cookie as usize as c_int
}

extern "C" fn cookie_read(cookie: *mut c_void, buf: *mut c_char, n: size_t) -> ssize_t {
    // SAFETY: the stream's buffer, handed to us by stdio (which takes -1 as an error
    // and 0 as end of file, as read's).
    unsafe { crate::calls::read(fd_of(cookie), buf.cast(), n) }
}

extern "C" fn cookie_write(cookie: *mut c_void, buf: *const c_char, n: size_t) -> ssize_t {
    let fd = fd_of(cookie);
    let mut done = 0usize;
    while done < n {
        // SAFETY: the unwritten rest of the stream's buffer.
        let r = unsafe { crate::calls::write(fd, buf.add(done).cast(), n - done) };
        if r < 0 {
            if real::errno() == libc::EINTR {
                continue;
            }
            // stdio wants the bytes written or an error (none may be half-reported).
            return if done > 0 { done as ssize_t } else { -1 };
        }
        done += r as usize;
    }
    done as ssize_t
}

extern "C" fn cookie_close(cookie: *mut c_void) -> c_int {
    let fd = fd_of(cookie);
    let mut s = STREAMS.lock().unwrap_or_else(|e| e.into_inner());
    s.retain(|&(_, f)| f != fd);
    LIVE.store(s.len(), Ordering::Relaxed);
    drop(s);
    // SAFETY: the stream owned the descriptor, as fclose expects.
    unsafe { crate::calls::close(fd) }
}

/// A stream over the accelerated socket `fd` (null on failure, errno set).
fn open(fd: c_int, mode: *const c_char) -> *mut FILE {
    let funcs = CookieIoFunctions {
        read: Some(cookie_read),
        write: Some(cookie_write),
        seek: None,
        close: Some(cookie_close),
    };
    // SAFETY: `mode` is the caller's C string; the cookie is the descriptor itself.
    let f = unsafe { fopencookie(fd as usize as *mut c_void, mode, funcs) };
    if !f.is_null() {
        let mut s = STREAMS.lock().unwrap_or_else(|e| e.into_inner());
        s.push((f as usize, fd));
        LIVE.store(s.len(), Ordering::Relaxed);
    }
    f
}

/// The descriptor of one of our streams.
fn stream_fd(f: *mut FILE) -> Option<c_int> {
    if LIVE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let s = STREAMS.lock().unwrap_or_else(|e| e.into_inner());
    s.iter().find(|&&(p, _)| p == f as usize).map(|&(_, fd)| fd)
}

/// In the constructor of a program started by `exec`: standard streams over
/// inherited accelerated sockets become ours. Runs before the program's `main`,
/// on its only thread.
pub fn adopt_standard_streams() {
    for fd in 0..3 {
        if crate::table::lookup(fd).is_none() {
            continue;
        }
        let mode = if fd == 0 { c"r" } else { c"w" };
        let f = open(fd, mode.as_ptr());
        if f.is_null() {
            continue;
        }
        // SAFETY: constructor time, single-threaded: nothing uses the standard streams
        // yet; the variables are glibc's (or the program's copies of them).
        unsafe {
            match fd {
                0 => stdin = f,
                1 => stdout = f,
                _ => {
                    // stderr stays unbuffered.
                    libc::setvbuf(f, std::ptr::null_mut(), libc::_IONBF, 0);
                    stderr = f
                }
            }
        }
    }
}

/// # Safety
/// As for libc's `fdopen`.
pub unsafe fn fdopen(fd: c_int, mode: *const c_char) -> *mut FILE {
    if crate::settle::accel(fd).is_some() {
        return open(fd, mode);
    }
    // SAFETY: forwarded arguments.
    unsafe { real::fdopen(fd, mode) }
}

/// # Safety
/// As for libc's `fileno`.
pub unsafe fn fileno(f: *mut FILE) -> c_int {
    if let Some(fd) = stream_fd(f) {
        return fd;
    }
    // SAFETY: forwarded argument.
    unsafe { real::fileno(f) }
}

/// # Safety
/// As for libc's `fileno_unlocked`.
pub unsafe fn fileno_unlocked(f: *mut FILE) -> c_int {
    if let Some(fd) = stream_fd(f) {
        return fd;
    }
    // SAFETY: forwarded argument.
    unsafe { real::fileno_unlocked(f) }
}
