//! Which descriptors are accelerated connections, strait listeners, or epoll sets with
//! accelerated members.
//!
//! Every interposed call first asks [`lookup`]; while no connection is accelerated
//! that is one relaxed load, so programs that never meet a strait peer pay nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use libc::c_int;

use crate::conn::Conn;
use crate::discover::Listener;

/// Number of descriptors in [`FDS`] (0: the fast path skips the lock).
static LIVE: AtomicUsize = AtomicUsize::new(0);
static FDS: RwLock<Vec<Option<Arc<Conn>>>> = RwLock::new(Vec::new());
static LISTENERS_LIVE: AtomicUsize = AtomicUsize::new(0);
static LISTENERS: Mutex<Vec<(c_int, Arc<Listener>)>> = Mutex::new(Vec::new());

pub fn lookup(fd: c_int) -> Option<Arc<Conn>> {
    if LIVE.load(Ordering::Relaxed) == 0 || fd < 0 {
        return None;
    }
    let t = FDS.read().unwrap_or_else(|e| e.into_inner());
    t.get(fd as usize).and_then(|c| c.clone())
}

pub fn any_live() -> bool {
    LIVE.load(Ordering::Relaxed) != 0
}

/// Registers `fd` as (another descriptor of) `conn`; returns the connection it
/// replaced, if `fd` was one.
pub fn insert(fd: c_int, conn: Arc<Conn>) -> Option<Arc<Conn>> {
    if fd < 0 {
        return None;
    }
    let mut t = FDS.write().unwrap_or_else(|e| e.into_inner());
    let i = fd as usize;
    if t.len() <= i {
        t.resize(i + 1, None);
    }
    let old = t[i].replace(conn);
    if old.is_none() {
        LIVE.fetch_add(1, Ordering::Relaxed);
    }
    old
}

/// Removes `fd`; returns its connection.
pub fn remove(fd: c_int) -> Option<Arc<Conn>> {
    if LIVE.load(Ordering::Relaxed) == 0 || fd < 0 {
        return None;
    }
    let mut t = FDS.write().unwrap_or_else(|e| e.into_inner());
    let old = t.get_mut(fd as usize).and_then(|c| c.take());
    if old.is_some() {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
    old
}

/// Removes every descriptor of `conn` (it fell back to the kernel).
pub fn remove_conn(conn: &Arc<Conn>) {
    let mut t = FDS.write().unwrap_or_else(|e| e.into_inner());
    for slot in t.iter_mut() {
        if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            *slot = None;
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// All distinct connections (for fork).
pub fn all_conns() -> Vec<Arc<Conn>> {
    if LIVE.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    let t = FDS.read().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<Arc<Conn>> = Vec::new();
    for c in t.iter().flatten() {
        if !v.iter().any(|x| Arc::ptr_eq(x, c)) {
            v.push(c.clone());
        }
    }
    v
}

/// One descriptor of a connection went away.
pub fn drop_ref(conn: Arc<Conn>) {
    if conn.fdrefs.fetch_sub(1, Ordering::AcqRel) == 1 {
        conn.release();
        crate::poll::forget_conn(&conn);
    }
}

pub fn listener(fd: c_int) -> Option<Arc<Listener>> {
    if LISTENERS_LIVE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    l.iter().find(|(f, _)| *f == fd).map(|(_, l)| l.clone())
}

pub fn add_listener(fd: c_int, l: Arc<Listener>) {
    let mut v = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    v.retain(|(f, _)| *f != fd);
    v.push((fd, l));
    LISTENERS_LIVE.store(v.len(), Ordering::Relaxed);
}

pub fn remove_listener(fd: c_int) {
    if LISTENERS_LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut v = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    v.retain(|(f, _)| *f != fd);
    LISTENERS_LIVE.store(v.len(), Ordering::Relaxed);
}
