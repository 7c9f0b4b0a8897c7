//! The `sfi_*` functions shim.c calls, and `fi_prov_ini`. Handles given to C are
//! boxed; every pointer from C is checked for null before use, and lengths come
//! with their buffers.

use std::ffi::c_void;
use std::sync::Arc;

use crate::matching::{fi, Comp};
use crate::proto::NAME_LEN;
use crate::provider::Domain;

/// What C holds for an address vector, completion queue or endpoint.
struct Handle {
    dom: Arc<Domain>,
    id: usize,
}

/// Borrows a handle C passed back.
fn handle<'a>(p: *mut c_void) -> Option<&'a Handle> {
    // SAFETY: every non-null pointer C passes here came from `new_handle` and is
    // not freed before the object's close (libfabric forbids use after close).
    unsafe { p.cast::<Handle>().as_ref() }
}

fn new_handle(dom: &Arc<Domain>, id: usize) -> *mut c_void {
    Box::into_raw(Box::new(Handle { dom: dom.clone(), id })).cast()
}

fn free_handle(p: *mut c_void) -> Option<Handle> {
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` came from `new_handle` (Box::into_raw) and C drops its copy now.
    Some(*unsafe { Box::from_raw(p.cast::<Handle>()) })
}

fn domain<'a>(p: *mut c_void) -> Option<&'a Arc<Domain>> {
    // SAFETY: non-null pointers passed here came from `sfi_domain_open` and live
    // until `sfi_domain_close`.
    unsafe { p.cast::<Arc<Domain>>().as_ref() }
}

extern "C" {
    fn strait_fi_provider() -> *mut c_void;
}

/// libfabric's entry point for an external provider.
#[no_mangle]
pub extern "C" fn fi_prov_ini() -> *mut c_void {
    // SAFETY: returns a pointer to shim.c's static provider structure.
    unsafe { strait_fi_provider() }
}

#[no_mangle]
extern "C" fn sfi_domain_open() -> *mut c_void {
    let d = Arc::new(Domain::default());
    crate::provider::start_ticker(&d);
    Box::into_raw(Box::new(d)).cast()
}

#[no_mangle]
extern "C" fn sfi_domain_close(d: *mut c_void) {
    if !d.is_null() {
        // SAFETY: `d` came from `sfi_domain_open`; C closes it once.
        drop(unsafe { Box::from_raw(d.cast::<Arc<Domain>>()) });
    }
}

#[no_mangle]
extern "C" fn sfi_addrlen() -> usize {
    NAME_LEN
}

#[no_mangle]
extern "C" fn sfi_av_open(d: *mut c_void) -> *mut c_void {
    match domain(d) {
        Some(dom) => new_handle(dom, dom.av_open()),
        None => std::ptr::null_mut(),
    }
}

#[no_mangle]
extern "C" fn sfi_av_close(av: *mut c_void) {
    if let Some(h) = free_handle(av) {
        h.dom.av_close(h.id);
    }
}

#[no_mangle]
extern "C" fn sfi_av_insert(av: *mut c_void, addr: *const c_void, count: usize, fi_addr: *mut u64) -> i32 {
    let Some(h) = handle(av) else { return -fi::EINVAL };
    if count == 0 {
        return 0;
    }
    let Some(bytes) = count.checked_mul(NAME_LEN) else { return -fi::EINVAL };
    if addr.is_null() {
        return -fi::EINVAL;
    }
    // SAFETY: fi_av_insert's contract: `addr` holds `count` addresses of the
    // provider's address length (NAME_LEN).
    let names = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), bytes) };
    let res = h.dom.av_insert(h.id, names);
    let mut n = 0;
    for (i, r) in res.iter().enumerate() {
        if r.is_some() {
            n += 1;
        }
        if !fi_addr.is_null() {
            // SAFETY: fi_av_insert's contract: `fi_addr` (when given) has room for
            // `count` entries; `i < count`.
            unsafe { *fi_addr.add(i) = r.unwrap_or(u64::MAX) };
        }
    }
    n
}

#[no_mangle]
extern "C" fn sfi_av_remove(av: *mut c_void, fi_addr: *const u64, count: usize) -> i32 {
    let Some(h) = handle(av) else { return -fi::EINVAL };
    if count == 0 {
        return 0;
    }
    if fi_addr.is_null() {
        return -fi::EINVAL;
    }
    // SAFETY: fi_av_remove's contract: `count` addresses at `fi_addr`.
    let addrs = unsafe { std::slice::from_raw_parts(fi_addr, count) };
    match h.dom.av_remove(h.id, addrs) {
        Ok(()) => 0,
        Err(e) => -e.errno(),
    }
}

#[no_mangle]
extern "C" fn sfi_av_lookup(av: *mut c_void, fi_addr: u64, addr: *mut c_void, addrlen: *mut usize) -> i32 {
    let Some(h) = handle(av) else { return -fi::EINVAL };
    if addrlen.is_null() {
        return -fi::EINVAL;
    }
    let Some(name) = h.dom.av_lookup(h.id, fi_addr) else { return -fi::ENOENT };
    copy_name(&name, addr, addrlen)
}

/// Copies a name into a caller's buffer of `*len` bytes (as much as fits), and sets
/// `*len` to the full length (libfabric's getname/lookup convention).
fn copy_name(name: &[u8; NAME_LEN], addr: *mut c_void, len: *mut usize) -> i32 {
    // SAFETY: `len` is non-null (checked by callers) and points at the caller's size_t.
    let room = unsafe { *len };
    if !addr.is_null() {
        // SAFETY: the caller's buffer holds `room` bytes; we write at most that.
        unsafe { std::ptr::copy_nonoverlapping(name.as_ptr(), addr.cast::<u8>(), room.min(NAME_LEN)) };
    }
    // SAFETY: as above.
    unsafe { *len = NAME_LEN };
    if room < NAME_LEN {
        -fi::ETOOSMALL
    } else {
        0
    }
}

#[no_mangle]
extern "C" fn sfi_cq_open(d: *mut c_void) -> *mut c_void {
    match domain(d) {
        Some(dom) => new_handle(dom, dom.cq_open()),
        None => std::ptr::null_mut(),
    }
}

#[no_mangle]
extern "C" fn sfi_cq_close(cq: *mut c_void) -> i32 {
    let Some(h) = handle(cq) else { return -fi::EINVAL };
    if let Err(e) = h.dom.cq_close(h.id) {
        return -e.errno();
    }
    free_handle(cq);
    0
}

#[no_mangle]
extern "C" fn sfi_cq_read(cq: *mut c_void, out: *mut Comp, count: usize) -> isize {
    let Some(h) = handle(cq) else { return -(fi::EINVAL as isize) };
    if out.is_null() {
        return -(fi::EINVAL as isize);
    }
    let mut sink = |i: usize, c: Comp| {
        // SAFETY: shim.c passes an array of `count` entries; cq_read hands out at
        // most `count` (`i < count`).
        unsafe { out.add(i).write(c) };
    };
    match h.dom.cq_read(h.id, count, &mut sink) {
        Ok(k) => k as isize,
        Err(true) => -(fi::EAVAIL as isize),
        Err(false) => -(fi::EAGAIN as isize),
    }
}

#[no_mangle]
extern "C" fn sfi_cq_readerr(cq: *mut c_void, out: *mut Comp) -> isize {
    let Some(h) = handle(cq) else { return -(fi::EINVAL as isize) };
    match h.dom.cq_readerr(h.id) {
        Some(c) if !out.is_null() => {
            // SAFETY: shim.c passes one entry's worth of memory.
            unsafe { *out = c };
            1
        }
        Some(_) => -(fi::EINVAL as isize),
        None => -(fi::EAGAIN as isize),
    }
}

#[no_mangle]
extern "C" fn sfi_ep_open(d: *mut c_void, directed: i32) -> *mut c_void {
    match domain(d) {
        Some(dom) => new_handle(dom, dom.ep_open(directed != 0)),
        None => std::ptr::null_mut(),
    }
}

#[no_mangle]
extern "C" fn sfi_ep_close(ep: *mut c_void) -> i32 {
    let Some(h) = free_handle(ep) else { return -fi::EINVAL };
    h.dom.ep_close(h.id);
    0
}

#[no_mangle]
extern "C" fn sfi_ep_bind_cq(ep: *mut c_void, cq: *mut c_void, flags: u64) -> i32 {
    let (Some(e), Some(q)) = (handle(ep), handle(cq)) else { return -fi::EINVAL };
    if !Arc::ptr_eq(&e.dom, &q.dom) {
        return -fi::EINVAL;
    }
    match e.dom.ep_bind_cq(e.id, q.id, flags) {
        Ok(()) => 0,
        Err(err) => -err.errno(),
    }
}

#[no_mangle]
extern "C" fn sfi_ep_bind_av(ep: *mut c_void, av: *mut c_void) -> i32 {
    let (Some(e), Some(a)) = (handle(ep), handle(av)) else { return -fi::EINVAL };
    if !Arc::ptr_eq(&e.dom, &a.dom) {
        return -fi::EINVAL;
    }
    match e.dom.ep_bind_av(e.id, a.id) {
        Ok(()) => 0,
        Err(err) => -err.errno(),
    }
}

#[no_mangle]
extern "C" fn sfi_ep_enable(ep: *mut c_void) -> i32 {
    let Some(e) = handle(ep) else { return -fi::EINVAL };
    match e.dom.ep_enable(e.id) {
        Ok(()) => 0,
        Err(err) => {
            if std::env::var_os("STRAIT_FI_DEBUG").is_some() {
                eprintln!("strait-fi: fi_enable: {err}");
            }
            -err.errno()
        }
    }
}

#[no_mangle]
extern "C" fn sfi_ep_getname(ep: *mut c_void, addr: *mut c_void, addrlen: *mut usize) -> i32 {
    let Some(e) = handle(ep) else { return -fi::EINVAL };
    if addrlen.is_null() {
        return -fi::EINVAL;
    }
    match e.dom.ep_getname(e.id) {
        Ok(name) => copy_name(&name, addr, addrlen),
        Err(err) => -err.errno(),
    }
}

#[no_mangle]
extern "C" fn sfi_ep_send(
    ep: *mut c_void,
    buf: *const c_void,
    len: usize,
    dest: u64,
    tag: u64,
    data: u64,
    flags: u64,
    ctx: *mut c_void,
) -> isize {
    let Some(e) = handle(ep) else { return -(fi::EINVAL as isize) };
    match e.dom.ep_send(e.id, buf as usize, len, dest, tag, data, flags, ctx as usize) {
        Ok(()) => 0,
        Err(err) => -(err.errno() as isize),
    }
}

#[no_mangle]
extern "C" fn sfi_ep_recv(
    ep: *mut c_void,
    buf: *mut c_void,
    len: usize,
    src: u64,
    tag: u64,
    ignore: u64,
    flags: u64,
    ctx: *mut c_void,
) -> isize {
    let Some(e) = handle(ep) else { return -(fi::EINVAL as isize) };
    match e.dom.ep_recv(e.id, buf as usize, len, src, tag, ignore, flags, ctx as usize) {
        Ok(()) => 0,
        Err(err) => -(err.errno() as isize),
    }
}

#[no_mangle]
extern "C" fn sfi_ep_cancel(ep: *mut c_void, ctx: *mut c_void) -> isize {
    let Some(e) = handle(ep) else { return -(fi::EINVAL as isize) };
    match e.dom.ep_cancel(e.id, ctx as usize) {
        Ok(()) => 0,
        Err(err) => -(err.errno() as isize),
    }
}
