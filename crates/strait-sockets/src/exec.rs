//! `exec` and `posix_spawn` of a program that inherits accelerated connections.
//!
//! An accelerated socket is an idle kernel socket plus a mapping in process memory;
//! `exec` keeps the first and discards the second. So just before the new program
//! starts, every local connection with a descriptor that survives the exec (one
//! without close-on-exec) is described in `STRAIT_HANDOFF` in the new program's
//! environment, next to inheritable copies of what carries it: the rings' memfd
//! (peeked out of the connection's vault, see `conn.rs`), both eventfds and the Unix
//! socket whose hang-up tells the peer we are gone. The library's constructor in the
//! new program maps the rings again and finds the connection's descriptors by the
//! kernel socket's inode, so descriptors renumbered on the way (`posix_spawn` file
//! actions, a shell's redirections) are found too. If the exec fails, the copies are
//! closed again and nothing changed.
//!
//! An exec'd program is the same process: it takes over this process's hold on the
//! connection (and gives it up at once if none of its descriptors survived). A
//! `posix_spawn`ed program is a new process: it gets a hold of its own, undone if the
//! spawn fails. `vfork` is `fork` here (as accelerators commonly do): a vfork child
//! runs in its parent's memory, where the library's bookkeeping for the child
//! would be the parent's.
//!
//! If the new program does not preload the library (`LD_PRELOAD` was dropped from
//! its environment), the handoff puts it back: without it the inherited socket
//! would reach the idle kernel socket and its bytes would never arrive.
//!
//! Connections to other hosts: a forked child (or spawned program) hands them over
//! like local ones, since the bridge that carries them lives in the parent, which
//! stays. The process that bridges them cannot: the bridge lives in the memory the
//! exec discards. Its connections end as at exit (what was written is sent, the peer
//! reads end of stream), and their sockets are shut down, so the new program reads
//! end of stream and its writes fail instead of meeting an idle kernel socket. UDP
//! sockets are not carried (see the crate README).

use std::ffi::{CStr, CString};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use libc::{c_char, c_int, pid_t};

use crate::conn::{Bells, Carriers, Conn, Liveness, PairBell, Shm, HDR};
use crate::{real, table};

const VAR: &str = "STRAIT_HANDOFF";
/// Listening sockets that survive an exec (`<socket>,...`; see [`listener_handoff`]).
const LISTENERS_VAR: &str = "STRAIT_LISTENERS";

extern "C" {
    static environ: *const *const c_char;
}

/// Connections handed to the new program by this process (counted by the
/// receiving side, in the new program's statistics as `inherited`).
pub static INHERITED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One connection as written into `STRAIT_HANDOFF` (or into a descriptor-passing
/// bundle, `pass.rs`, where the descriptor fields are indices into the bundle's
/// descriptors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    /// Inode of the kernel socket (the same in every descriptor of it).
    pub(crate) ino: u64,
    pub(crate) side: usize,
    pub(crate) ring: usize,
    pub(crate) memfd: c_int,
    /// Our eventfd, or (a connection of a process pair) the pair's bell we wait on.
    pub(crate) my_efd: c_int,
    /// The peer's eventfd, or the pair's bell we ring.
    pub(crate) peer_efd: c_int,
    /// The library's liveness socket ([`crate::conn::Liveness::Socket`]), or -1:
    /// the TCP socket itself tells.
    pub(crate) hup: c_int,
    /// `Conn::shut_flags`.
    pub(crate) shut: u8,
    /// The process pair the connection rings through, if it does.
    pub(crate) pair: Option<PairRecord>,
}

/// A connection's process pair in a [`Record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PairRecord {
    /// The pair's memfd.
    pub(crate) memfd: c_int,
    /// The half the connection's end reads.
    pub(crate) half: crate::pair::Half,
    /// Another process may read that half too (a spawned program, a process a
    /// descriptor was passed to, a fork before).
    pub(crate) shared: bool,
    pub(crate) my_slot: u32,
    pub(crate) peer_slot: u32,
}

impl Record {
    pub(crate) fn encode(&self) -> String {
        let base = format!(
            "{}:{}:{}:{}:{}:{}:{}:{}",
            self.ino, self.side, self.ring, self.memfd, self.my_efd, self.peer_efd, self.hup, self.shut
        );
        match self.pair {
            None => base,
            Some(p) => {
                let flags = u8::from(p.half == crate::pair::Half::Creator) | (u8::from(p.shared) << 1);
                format!("{base}:{}:{}:{}:{flags}", p.memfd, p.my_slot, p.peer_slot)
            }
        }
    }

    /// Parses one record; `None` for anything malformed (the variable comes from the
    /// environment, which the program may have changed).
    pub(crate) fn parse(s: &str) -> Option<Record> {
        let f: Vec<&str> = s.split(':').collect();
        if f.len() != 8 && f.len() != 12 {
            return None;
        }
        let fd = |i: usize| f[i].parse::<c_int>().ok().filter(|&v| v >= 0);
        let side = f[1].parse::<usize>().ok().filter(|&s| s <= 1)?;
        let ring = f[2].parse::<usize>().ok().filter(|&r| r > 0 && r <= 1 << 30)?;
        Some(Record {
            ino: f[0].parse().ok()?,
            side,
            ring,
            memfd: fd(3)?,
            my_efd: fd(4)?,
            peer_efd: fd(5)?,
            hup: f[6].parse::<c_int>().ok().filter(|&v| v >= -1)?,
            shut: f[7].parse().ok()?,
            pair: if f.len() == 12 {
                let flags = f[11].parse::<u8>().ok()?;
                Some(PairRecord {
                    memfd: fd(8)?,
                    my_slot: f[9].parse().ok()?,
                    peer_slot: f[10].parse().ok()?,
                    half: if flags & 1 != 0 { crate::pair::Half::Creator } else { crate::pair::Half::Other },
                    shared: flags & 2 != 0,
                })
            } else {
                None
            },
        })
    }
}

/// What was made ready for one exec or spawn.
struct Handoff {
    /// `STRAIT_HANDOFF=...` (None: nothing to hand over).
    entry: Option<CString>,
    /// The inheritable copies (closed in this process afterwards).
    fds: Vec<c_int>,
    /// Connections given an extra hold for a spawned process.
    held: Vec<Arc<Conn>>,
    /// Sockets of bridged connections that end with this program.
    ended: Vec<c_int>,
}

impl Handoff {
    /// Closes the copies; `undo_holds` also gives back the spawned process's holds.
    fn finish(self, undo_holds: bool) {
        crate::sock::close_all(&self.fds);
        if undo_holds {
            for c in &self.held {
                c.drop_holder();
            }
        }
    }
}

pub(crate) fn inode(fd: c_int) -> Option<u64> {
    // SAFETY: stat is plain old data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a local stat.
    (unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_mode & libc::S_IFMT == libc::S_IFSOCK)
        .then_some(st.st_ino)
}

fn inheritable_dup(fd: c_int) -> c_int {
    // SAFETY: plain syscall (F_DUPFD leaves close-on-exec clear).
    unsafe { real::fcntl(fd, libc::F_DUPFD, 0) }
}

/// Gets every local connection that the new program will hold ready for it.
/// `new_process`: a spawned process (its own hold); `all`: also connections whose
/// descriptors are all close-on-exec (spawn file actions may dup them to others).
fn prepare(new_process: bool, all: bool) -> Handoff {
    let mut h = Handoff { entry: None, fds: Vec::new(), held: Vec::new(), ended: Vec::new() };
    let entries = table::entries();
    let mut records: Vec<String> = Vec::new();
    let mut done: Vec<*const Conn> = Vec::new();
    for (fd, c) in &entries {
        // Settles a pending connect first (bounded, also on a non-blocking socket:
        // the new program must know which path it is on); a connection that fell
        // back to the kernel needs nothing.
        if c.awaiting_attach() {
            c.settle(*fd);
        }
        let Some(c) = crate::settle::accel(*fd) else { continue };
        if done.contains(&Arc::as_ptr(&c)) {
            continue;
        }
        done.push(Arc::as_ptr(&c));
        if !c.vault.is_some() || !c.attached() {
            continue;
        }
        let fds: Vec<c_int> = entries.iter().filter(|(_, x)| Arc::ptr_eq(x, &c)).map(|(f, _)| *f).collect();
        // A connection to another host that this process bridges ends with this
        // program (`end_bridges`); the new one must not talk to the idle kernel
        // socket as if it were the connection: it reads end of stream, its writes
        // fail. A forked child's (or a spawned program's) bridge stays with us.
        if !new_process && c.remote.get().is_some_and(|b| b.owned_here()) {
            h.ended.extend_from_slice(&fds);
            continue;
        }
        // SAFETY: plain syscall.
        let survives =
            fds.iter().any(|&f| unsafe { real::fcntl(f, libc::F_GETFD, 0) } & libc::FD_CLOEXEC == 0);
        if !(survives || all) {
            continue;
        }
        // A spawned program (or the child that execs) holds the pair beside us.
        let Some((record, copies)) = record_for(*fd, &c, new_process) else { continue };
        h.fds.extend_from_slice(&copies);
        records.push(record.encode());
        if new_process {
            c.add_holder();
            h.held.push(c);
        }
    }
    if !records.is_empty() {
        h.entry = CString::new(format!("{VAR}={}", records.join(","))).ok();
    }
    h
}

/// Copies of what carries connection `c` (whose descriptor `fd` is one): the memfd
/// (a copy from the vault, which keeps it), both eventfds (or its process pair's
/// bells), the library's liveness socket if it has one, and its pair's memfd if it
/// has one, none close-on-exec, owned by the caller; and the record that describes
/// them (its descriptor fields are those copies). `shared`: another process will
/// hold the pair beside this one (the record says so, and this process's pair
/// is marked so too).
pub(crate) fn record_for(fd: c_int, c: &Conn, shared: bool) -> Option<(Record, Vec<c_int>)> {
    let ino = inode(fd)?;
    let vault_copy = |k: crate::vault::Kept| {
        let m = crate::vault::copy(k)?;
        // (The vault's copies are close-on-exec.)
        // SAFETY: plain syscall on the copy we own.
        unsafe { real::fcntl(m, libc::F_SETFD, 0) };
        Some(m)
    };
    let memfd = vault_copy(c.vault)?;
    let pair = if c.uses_pairs() { Some(c.pair_bell()?) } else { None };
    let (mine, peers) = match pair {
        Some(b) => {
            let [cr, ot] = b.pair.bells();
            match b.pair.half() {
                crate::pair::Half::Creator => (cr, ot),
                crate::pair::Half::Other => (ot, cr),
            }
        }
        None => (c.my_efd, c.peer_efd),
    };
    let mut copies = vec![memfd, inheritable_dup(mine), inheritable_dup(peers)];
    let hup = if c.watched_by_socket() {
        -1
    } else {
        copies.push(inheritable_dup(c.hup_fd(-1)));
        copies[copies.len() - 1]
    };
    let pair = match pair {
        None => None,
        Some(b) => {
            let m = vault_copy(b.pair.kept()).unwrap_or(-1);
            copies.push(m);
            if shared {
                b.pair.mark_shared();
            }
            Some(PairRecord {
                memfd: m,
                half: b.pair.half(),
                shared: shared || b.pair.is_shared(),
                my_slot: b.my_slot,
                peer_slot: b.peer_slot,
            })
        }
    };
    if copies.iter().any(|&f| f < 0) {
        crate::sock::close_all(&copies.iter().copied().filter(|&f| f >= 0).collect::<Vec<_>>());
        return None;
    }
    let record = Record {
        ino,
        side: c.side,
        ring: c.shm.ring,
        memfd: copies[0],
        my_efd: copies[1],
        peer_efd: copies[2],
        hup,
        shut: c.shut_flags(),
        pair,
    };
    Some((record, copies))
}

/// This library's file name, for `LD_PRELOAD`.
fn library_path() -> Option<CString> {
    // SAFETY: Dl_info is plain old data; dladdr fills it for an address in this library.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: the address of a function of this library.
    if unsafe { libc::dladdr(adopt as *const libc::c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr returned a NUL-terminated name that lives as long as the library.
    Some(unsafe { CStr::from_ptr(info.dli_fname) }.to_owned())
}

/// The new program's environment: the caller's, without a stale handoff, with ours,
/// and with this library in `LD_PRELOAD`.
struct Env {
    _owned: Vec<CString>,
    ptrs: Vec<*const c_char>,
}

impl Env {
    /// # Safety
    /// `envp` is null or a NULL-terminated array of C strings.
    unsafe fn new(envp: *const *const c_char, entries: &[&CString]) -> Env {
        let mut owned: Vec<CString> = entries.iter().map(|&c| c.clone()).collect();
        let mut ptrs: Vec<*const c_char> = Vec::new();
        let lib = library_path();
        let mut preload_ok = false;
        let mut i = 0;
        while !envp.is_null() {
            // SAFETY: within the caller's NULL-terminated array.
            let p = unsafe { *envp.add(i) };
            if p.is_null() {
                break;
            }
            i += 1;
            // SAFETY: an entry of the environment array is a C string.
            let s = unsafe { CStr::from_ptr(p) }.to_bytes();
            if s.starts_with(b"STRAIT_HANDOFF=") || s.starts_with(b"STRAIT_LISTENERS=") {
                continue;
            }
            if let (Some(v), Some(lib)) = (s.strip_prefix(b"LD_PRELOAD="), lib.as_ref()) {
                let name = lib.to_bytes();
                if v.split(|&b| b == b':' || b == b' ')
                    .any(|e| e == name || e.ends_with(b"libstrait_preload.so"))
                {
                    preload_ok = true;
                } else {
                    let mut e = b"LD_PRELOAD=".to_vec();
                    e.extend_from_slice(name);
                    if !v.is_empty() {
                        e.push(b':');
                        e.extend_from_slice(v);
                    }
                    if let Ok(c) = CString::new(e) {
                        owned.push(c);
                        preload_ok = true;
                        continue;
                    }
                }
            }
            ptrs.push(p);
        }
        if let (false, Some(lib)) = (preload_ok, lib) {
            let mut e = b"LD_PRELOAD=".to_vec();
            e.extend_from_slice(lib.to_bytes());
            if let Ok(c) = CString::new(e) {
                owned.push(c);
            }
        }
        // The CStrings' buffers do not move when the Vec that owns them grows.
        ptrs.extend(owned.iter().map(|c| c.as_ptr()));
        ptrs.push(std::ptr::null());
        Env { _owned: owned, ptrs }
    }

    fn as_ptr(&self) -> *const *const c_char {
        self.ptrs.as_ptr()
    }
}

/// An exec with no connection to hand over: if a strait listening socket survives
/// it (socket activation: `systemd-socket-activate` execs the service with a clean
/// environment and the listener as descriptor 3), the new program gets the library
/// back in `LD_PRELOAD`, so that it accelerates that listener's connections.
fn call_keeping_preload(
    envp: *const *const c_char,
    call: impl FnOnce(*const *const c_char) -> c_int,
) -> c_int {
    let survives =
        table::listening_entries().iter().any(|(fd, l)| l.local.get().is_some() && survives_exec(*fd));
    if !survives {
        return call(envp);
    }
    let handoff = listener_handoff();
    let entries: Vec<&CString> = handoff.iter().collect();
    // SAFETY: `envp` comes from the caller of exec, who promises a valid array.
    let env = unsafe { Env::new(envp, &entries) };
    call(env.as_ptr())
}

/// True if `fd` stays open across an exec (no close-on-exec).
fn survives_exec(fd: c_int) -> bool {
    // SAFETY: plain fcntl on a descriptor number.
    let flags = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
    flags >= 0 && flags & libc::FD_CLOEXEC == 0
}

/// The `STRAIT_LISTENERS` entry for an exec: the listening sockets with a strait side
/// that survive it (`None` if none does). The new program's constructor registers
/// them at once, taking their names back, so that a connector arriving before the new
/// program's first `accept` (socket activation: `systemd-socket-activate` execs the
/// service when the first connection comes, and the service may take its time) is
/// carried; without it the names stayed free until that first `accept`. (The markers
/// themselves are not handed over: a program that never loads the library, a static
/// or set-user-ID one, would then hold a name it never serves, and every connector
/// would wait out the attach timeout.)
fn listener_handoff() -> Option<CString> {
    let mut fds: Vec<String> = Vec::new();
    let mut seen: Vec<Arc<crate::listening::Listening>> = Vec::new();
    for (fd, l) in table::listening_entries() {
        // One descriptor per listening socket (the others of the same socket are
        // adopted at their first accept).
        if l.local.get().is_none() || !survives_exec(fd) || seen.iter().any(|s| Arc::ptr_eq(s, &l)) {
            continue;
        }
        fds.push(fd.to_string());
        seen.push(l);
    }
    if fds.is_empty() {
        return None;
    }
    CString::new(format!("{LISTENERS_VAR}={}", fds.join(","))).ok()
}

/// In the library's constructor: registers the listening sockets the previous
/// program handed over (see [`listener_handoff`]), each taking its name back. A
/// number that is not a listening TCP socket is ignored.
fn adopt_listeners() {
    let Some(v) = std::env::var_os(LISTENERS_VAR) else { return };
    // SAFETY: as in `adopt`: the constructor runs alone, before the program.
    unsafe { libc::unsetenv(c"STRAIT_LISTENERS".as_ptr()) };
    for fd in v.to_string_lossy().split(',').filter_map(|f| f.parse::<c_int>().ok()) {
        if fd >= 0
            && crate::sock::socket_option(fd, libc::SO_ACCEPTCONN) == Some(1)
            && crate::sock::is_tcp_stream(fd)
        {
            crate::discover::on_listen(fd);
        }
    }
}

/// Runs an exec-like `call` with the handoff in its environment `envp`.
fn exec_with(envp: *const *const c_char, call: impl FnOnce(*const *const c_char) -> c_int) -> c_int {
    // Connections to other hosts bridged here end now, as at exit, with their data
    // sent (also those the program already closed: their bridges may still be
    // sending); the new program finds their sockets shut.
    if !table::any_live() {
        crate::remote::end_bridges();
        return call_keeping_preload(envp, call);
    }
    let h = prepare(false, false);
    crate::remote::end_bridges();
    for &fd in &h.ended {
        // SAFETY: shuts down the program's (idle) kernel socket.
        unsafe { real::shutdown(fd, libc::SHUT_RDWR) };
    }
    let Some(entry) = h.entry.as_ref() else {
        h.finish(false);
        return call_keeping_preload(envp, call);
    };
    let listeners = listener_handoff();
    let entries: Vec<&CString> = std::iter::once(entry).chain(listeners.as_ref()).collect();
    // SAFETY: `envp` comes from the caller of exec, who promises a valid array.
    let env = unsafe { Env::new(envp, &entries) };
    let r = call(env.as_ptr());
    // Only reached if the exec failed.
    let e = real::errno();
    h.finish(false);
    real::set_errno(e);
    r
}

/// Runs a spawn-like `call` with the handoff in the child's environment `envp`.
fn spawn_with(
    envp: *const *const c_char,
    actions: bool,
    call: impl FnOnce(*const *const c_char) -> c_int,
) -> c_int {
    if !table::any_live() {
        return call(envp);
    }
    let h = prepare(true, actions);
    let Some(entry) = h.entry.as_ref() else {
        h.finish(false);
        return call(envp);
    };
    // SAFETY: `envp` comes from the caller, who promises a valid array.
    let env = unsafe { Env::new(envp, &[entry]) };
    let r = call(env.as_ptr());
    h.finish(r != 0);
    r
}

fn environ_ptr() -> *const *const c_char {
    // SAFETY: reads the process's environment pointer (libc's global).
    unsafe { environ }
}

// ------------------------------------------------------------------ the new program

/// Descriptors of this process that are sockets, with their inodes.
fn socket_fds() -> Vec<(c_int, u64)> {
    let fds = strait_sys::procfs::own_fds().unwrap_or_default();
    fds.into_iter().filter_map(|fd| Some((fd, inode(fd)?))).collect()
}

/// In the library's constructor: takes over the connections the previous program
/// (or the spawning process) handed over.
pub fn adopt() {
    adopt_listeners();
    let Some(v) = std::env::var_os(VAR) else { return };
    // SAFETY: the constructor runs before the program's code, on its only thread, so
    // nothing else reads the environment now. The variable must not reach the next
    // program: its descriptor numbers mean nothing there.
    unsafe { libc::unsetenv(c"STRAIT_HANDOFF".as_ptr()) };
    let records: Vec<Record> = v.to_string_lossy().split(',').filter_map(Record::parse).collect();
    if records.is_empty() {
        return;
    }
    let socks = socket_fds();
    for r in records {
        adopt_one(r, &socks);
    }
}

/// Takes over one handed-over connection: maps its rings and enters the
/// descriptors in `socks` (descriptor, socket inode) that are its socket. Returns
/// whether it did.
pub(crate) fn adopt_one(r: Record, socks: &[(c_int, u64)]) -> bool {
    // Only a sealed memfd of the right size is ours; anything else (a stale or forged
    // variable) is left alone, descriptors included.
    if !crate::sock::memfd_ok(r.memfd, HDR + 2 * r.ring) {
        return false;
    }
    let carriers: Vec<c_int> = [r.memfd, r.my_efd, r.peer_efd, r.hup, r.pair.map_or(-1, |p| p.memfd)]
        .into_iter()
        .filter(|&f| f >= 0)
        .collect();
    for &fd in &carriers {
        // SAFETY: plain syscall on a descriptor handed to us.
        unsafe { real::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC as usize) };
    }
    let shm = Shm::map(r.memfd, r.ring).filter(|s| s.header_ok());
    let vault = if shm.is_some() { crate::vault::keep(r.memfd) } else { crate::vault::Kept::Nothing };
    crate::sock::close_all(&[r.memfd]);
    let Some(shm) = shm else {
        crate::sock::close_all(&carriers[1..]);
        return false;
    };
    // The pair (the one this process holds already under its inode and half, if
    // any), with our slot taken again.
    let bells = match r.pair {
        None => Bells::Own { mine: r.my_efd, peer: r.peer_efd },
        Some(p) => {
            let creator_first = match p.half {
                crate::pair::Half::Creator => [r.my_efd, r.peer_efd],
                crate::pair::Half::Other => [r.peer_efd, r.my_efd],
            };
            let pair = crate::pair::reopen(p.memfd, creator_first, p.half, p.shared);
            let Some(pair) = pair.ok().filter(|q| q.claim_exact(p.my_slot)) else {
                crate::sock::close_all(&[r.hup].into_iter().filter(|&f| f >= 0).collect::<Vec<_>>());
                crate::vault::release(vault);
                return false;
            };
            Bells::Pair(PairBell { pair, my_slot: p.my_slot, peer_slot: p.peer_slot })
        }
    };
    let fds: Vec<c_int> = socks.iter().filter(|s| s.1 == r.ino).map(|s| s.0).collect();
    // SAFETY: plain syscall.
    let nonblock =
        fds.first().is_some_and(|&fd| unsafe { real::fcntl(fd, libc::F_GETFL, 0) } & libc::O_NONBLOCK != 0);
    let c = Arc::new(Conn::new(
        shm,
        r.side,
        Carriers {
            bells,
            liveness: if r.hup >= 0 { Liveness::Socket(r.hup) } else { Liveness::TcpSocket },
            vault,
            // Not known here (the record comes from the environment or another
            // process): the ring only.
            peer_pid: None,
        },
        nonblock,
        None,
    ));
    c.bind_bells();
    c.counted.store(true, Ordering::Relaxed);
    c.restore_shut_flags(r.shut);
    if fds.is_empty() {
        // None of the socket's descriptors survived: our hold ends here.
        c.release();
        return false;
    }
    c.fdrefs.store(fds.len(), Ordering::Relaxed);
    for fd in fds {
        if let Some(old) = table::insert(fd, c.clone()) {
            table::drop_ref(old);
        }
    }
    INHERITED.fetch_add(1, Ordering::Relaxed);
    true
}

// ------------------------------------------------------------------ interposed calls

/// Defines the exec call `$name` (the cdylib exports it), with libc's arguments: runs
/// `real::$real(...)` through [`exec_with`] on the environment `$envp`, which the
/// call receives as `$env` (with what the library passes on added).
macro_rules! exec_shim {
    ($name:ident($($arg:ident: $ty:ty),*), $envp:expr, |$env:ident| $real:ident($($call:expr),*)) => {
        /// # Safety
        #[doc = concat!("As for libc's `", stringify!($name), "`.")]
        pub unsafe fn $name($($arg: $ty),*) -> c_int {
            // SAFETY: forwarded arguments.
            exec_with($envp, |$env| unsafe { real::$real($($call),*) })
        }
    };
}

/// A NULL-terminated array of C strings: an `argv` or an `envp`.
type CStrs = *const *const c_char;

exec_shim!(execve(path: *const c_char, argv: CStrs, envp: CStrs), envp, |env| execve(path, argv, env));
exec_shim!(execv(path: *const c_char, argv: CStrs), environ_ptr(), |env| execve(path, argv, env));
exec_shim!(execvp(file: *const c_char, argv: CStrs), environ_ptr(), |env| execvpe(file, argv, env));
exec_shim!(execvpe(file: *const c_char, argv: CStrs, envp: CStrs), envp, |env| execvpe(file, argv, env));
exec_shim!(fexecve(fd: c_int, argv: CStrs, envp: CStrs), envp, |env| fexecve(fd, argv, env));
exec_shim!(
    execveat(dirfd: c_int, path: *const c_char, argv: CStrs, envp: CStrs, flags: c_int),
    envp,
    |env| execveat(dirfd, path, argv, env, flags)
);

/// Defines `$name` (`posix_spawn` or `posix_spawnp`, whose second
/// argument is `$file`): runs `real::$name` through [`spawn_with`].
macro_rules! spawn_shim {
    ($name:ident, $file:ident) => {
        /// # Safety
        #[doc = concat!("As for libc's `", stringify!($name), "`.")]
        pub unsafe fn $name(
            pid: *mut pid_t,
            $file: *const c_char,
            actions: *const libc::posix_spawn_file_actions_t,
            attr: *const libc::posix_spawnattr_t,
            argv: *const *mut c_char,
            envp: *const *mut c_char,
        ) -> c_int {
            // SAFETY: forwarded arguments.
            spawn_with(envp.cast(), !actions.is_null(), |env| unsafe {
                real::$name(pid, $file, actions, attr, argv, env.cast())
            })
        }
    };
}

spawn_shim!(posix_spawn, path);
spawn_shim!(posix_spawnp, file);

// ------------------------------------------------------------ system() and popen()

/// The shell `system` and `popen` run, as glibc's.
const SHELL: &CStr = c"/bin/sh";

/// `system` callers in flight, and the SIGINT and SIGQUIT dispositions the first of
/// them replaced (glibc's `do_system` keeps the same count: concurrent callers
/// restore the caller's dispositions only when the last one returns).
static SYSTEM_SIGNALS: std::sync::Mutex<(usize, Option<(SigAction, SigAction)>)> =
    std::sync::Mutex::new((0, None));

/// A `libc::sigaction` that may live in a static (plain data: a handler address,
/// a mask, flags).
#[derive(Clone, Copy)]
struct SigAction(libc::sigaction);

// SAFETY: plain data; the handler address is only handed back to sigaction.
unsafe impl Send for SigAction {}

/// # Safety
/// As for libc's `system`.
pub unsafe fn system(line: *const c_char) -> c_int {
    if line.is_null() || !table::any_live() {
        // SAFETY: forwarded argument.
        return unsafe { real::system(line) };
    }
    // SAFETY: `line` is the caller's NUL-terminated command.
    unsafe { system_handing_over(line) }
}

/// `system` with the handoff, following glibc's `do_system`: while the command runs
/// the caller ignores SIGINT and SIGQUIT and blocks SIGCHLD; the shell starts with
/// the caller's signal mask and with SIGINT and SIGQUIT at their defaults unless the
/// caller ignored them.
///
/// # Safety
/// `line` is a NUL-terminated string.
unsafe fn system_handing_over(line: *const c_char) -> c_int {
    // SAFETY (whole function): signal and spawn-attribute calls on local,
    // initialised structures; `line` and the literals outlive the spawn.
    unsafe {
        let mut ignore: libc::sigaction = std::mem::zeroed();
        ignore.sa_sigaction = libc::SIG_IGN;
        libc::sigemptyset(&mut ignore.sa_mask);
        let (intr, quit) = {
            let mut g = SYSTEM_SIGNALS.lock().unwrap_or_else(|e| e.into_inner());
            if g.0 == 0 {
                let (mut intr, mut quit): (libc::sigaction, libc::sigaction) =
                    (std::mem::zeroed(), std::mem::zeroed());
                libc::sigaction(libc::SIGINT, &ignore, &mut intr);
                libc::sigaction(libc::SIGQUIT, &ignore, &mut quit);
                g.1 = Some((SigAction(intr), SigAction(quit)));
            }
            g.0 += 1;
            g.1.map(|(i, q)| (i.0, q.0)).unwrap_or((ignore, ignore))
        };
        let mut chld: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut chld);
        libc::sigaddset(&mut chld, libc::SIGCHLD);
        let mut omask: libc::sigset_t = std::mem::zeroed();
        libc::sigprocmask(libc::SIG_BLOCK, &chld, &mut omask);
        let mut reset: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut reset);
        if intr.sa_sigaction != libc::SIG_IGN {
            libc::sigaddset(&mut reset, libc::SIGINT);
        }
        if quit.sa_sigaction != libc::SIG_IGN {
            libc::sigaddset(&mut reset, libc::SIGQUIT);
        }
        let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
        libc::posix_spawnattr_init(&mut attr);
        libc::posix_spawnattr_setsigmask(&mut attr, &omask);
        libc::posix_spawnattr_setsigdefault(&mut attr, &reset);
        libc::posix_spawnattr_setflags(
            &mut attr,
            (libc::POSIX_SPAWN_SETSIGDEF | libc::POSIX_SPAWN_SETSIGMASK) as _,
        );
        let (r, pid) = spawn_shell(line, std::ptr::null(), &attr);
        libc::posix_spawnattr_destroy(&mut attr);
        let status = if r == 0 { wait_for(pid) } else { 127 << 8 };
        {
            let mut g = SYSTEM_SIGNALS.lock().unwrap_or_else(|e| e.into_inner());
            g.0 -= 1;
            if g.0 == 0 {
                if let Some((intr, quit)) = g.1.take() {
                    libc::sigaction(libc::SIGINT, &intr.0, std::ptr::null_mut());
                    libc::sigaction(libc::SIGQUIT, &quit.0, std::ptr::null_mut());
                }
            }
        }
        libc::sigprocmask(libc::SIG_SETMASK, &omask, std::ptr::null_mut());
        if r != 0 {
            real::set_errno(r);
        }
        status
    }
}

/// Starts `sh -c -- command` (as glibc's `system` and `popen` do) with the handoff
/// in its environment: (posix_spawn's result, the shell's pid).
///
/// # Safety
/// `command` is a NUL-terminated string; `actions` and `attr` are null or
/// initialised.
unsafe fn spawn_shell(
    command: *const c_char,
    actions: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
) -> (c_int, pid_t) {
    let argv = [c"sh".as_ptr(), c"-c".as_ptr(), c"--".as_ptr(), command, std::ptr::null()];
    let mut pid: pid_t = 0;
    let r = spawn_with(environ_ptr(), false, |env| {
        // SAFETY: a NUL-terminated argument list and environment; the caller's
        // actions and attributes.
        unsafe {
            real::posix_spawn(&mut pid, SHELL.as_ptr(), actions, attr, argv.as_ptr().cast(), env.cast())
        }
    });
    (r, pid)
}

/// Waits for `pid` (through interruptions): its wait status, or -1.
fn wait_for(pid: pid_t) -> c_int {
    loop {
        let mut st = 0;
        // SAFETY: waits for our own child into a local.
        let w = unsafe { libc::waitpid(pid, &mut st, 0) };
        if w == pid {
            return st;
        }
        if w < 0 && real::errno() == libc::EINTR {
            continue;
        }
        return -1;
    }
}

/// Streams made by this library's `popen`, for `pclose`: (stream, its descriptor,
/// the shell's pid).
static POPENED: std::sync::Mutex<Vec<(usize, c_int, pid_t)>> = std::sync::Mutex::new(Vec::new());

/// # Safety
/// As for libc's `popen`.
pub unsafe fn popen(command: *const c_char, mode: *const c_char) -> *mut libc::FILE {
    if command.is_null() || mode.is_null() || !table::any_live() {
        // SAFETY: forwarded arguments.
        return unsafe { real::popen(command, mode) };
    }
    // SAFETY: both are the caller's NUL-terminated strings.
    unsafe { popen_handing_over(command, CStr::from_ptr(mode).to_bytes()) }
}

/// `popen` with the handoff, as glibc's: a pipe whose child end becomes the shell's
/// standard input or output, streams of earlier `popen`s closed in the shell, and the
/// parent's end inheritable unless the mode has `e`.
///
/// # Safety
/// `command` is a NUL-terminated string.
unsafe fn popen_handing_over(command: *const c_char, mode: &[u8]) -> *mut libc::FILE {
    let reading = match mode.first() {
        Some(b'r') => true,
        Some(b'w') => false,
        _ => {
            real::set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        }
    };
    let cloexec = mode[1..].contains(&b'e');
    let mut p = [0 as c_int; 2];
    // SAFETY (whole block): pipe, descriptor and spawn calls on our own descriptors
    // and local, initialised structures; `command` outlives the spawn.
    unsafe {
        if libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return std::ptr::null_mut();
        }
        let (parent_end, mut child_end, child_std) = if reading { (p[0], p[1], 1) } else { (p[1], p[0], 0) };
        if child_end == child_std {
            // dup2 onto itself would leave it close-on-exec in the shell.
            let moved = real::fcntl(child_end, libc::F_DUPFD_CLOEXEC, 3);
            real::close(child_end);
            child_end = moved;
            if moved < 0 {
                real::close(parent_end);
                return std::ptr::null_mut();
            }
        }
        let mut fa: libc::posix_spawn_file_actions_t = std::mem::zeroed();
        libc::posix_spawn_file_actions_init(&mut fa);
        libc::posix_spawn_file_actions_adddup2(&mut fa, child_end, child_std);
        let earlier: Vec<c_int> =
            POPENED.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|e| e.1).collect();
        for fd in earlier.into_iter().filter(|&fd| fd != child_std) {
            libc::posix_spawn_file_actions_addclose(&mut fa, fd);
        }
        let (r, pid) = spawn_shell(command, &fa, std::ptr::null());
        libc::posix_spawn_file_actions_destroy(&mut fa);
        real::close(child_end);
        if r != 0 {
            real::close(parent_end);
            real::set_errno(r);
            return std::ptr::null_mut();
        }
        if !cloexec {
            real::fcntl(parent_end, libc::F_SETFD, 0);
        }
        let f = real::fdopen(parent_end, if reading { c"r".as_ptr() } else { c"w".as_ptr() });
        if f.is_null() {
            let e = real::errno();
            real::close(parent_end);
            wait_for(pid);
            real::set_errno(e);
            return f;
        }
        POPENED.lock().unwrap_or_else(|e| e.into_inner()).push((f as usize, parent_end, pid));
        f
    }
}

/// # Safety
/// As for libc's `pclose`.
pub unsafe fn pclose(f: *mut libc::FILE) -> c_int {
    let mine = {
        let mut v = POPENED.lock().unwrap_or_else(|e| e.into_inner());
        v.iter().position(|e| e.0 == f as usize).map(|i| v.swap_remove(i))
    };
    let Some((_, _, pid)) = mine else {
        // SAFETY: forwarded argument (a stream of libc's own popen).
        return unsafe { real::pclose(f) };
    };
    // SAFETY: the stream this library's popen made; closed once, here.
    unsafe { libc::fclose(f) };
    wait_for(pid)
}

/// `vfork` is `fork` (see the module doc).
///
/// # Safety
/// As for libc's `vfork`; the child gets its own memory, which a correct vfork
/// child cannot tell.
pub unsafe fn vfork() -> pid_t {
    // SAFETY: plain fork; the at-fork handlers keep the connections' holds right.
    unsafe { libc::fork() }
}

/// The variadic `execl`, `execlp` and `execle` land here: stable Rust cannot define a
/// C-variadic function, so the cdylib exports each as a naked trampoline that stores
/// the six argument registers next to the caller's stack arguments and calls this
/// with both; the integer arguments of a variadic call sit exactly there (System V
/// x86-64 ABI).
///
/// `kind` 0: execl(path, arg0, ..., NULL); 1: execlp(file, arg0, ..., NULL);
/// 2: execle(path, arg0, ..., NULL, envp).
///
/// # Safety
/// `regs` holds the six register arguments, `stack` points at the caller's stack
/// arguments, of a call with the documented argument list.
#[cfg(target_arch = "x86_64")]
pub unsafe extern "C" fn exec_list(regs: *const usize, stack: *const usize, kind: c_int) -> c_int {
    // SAFETY: argument `i` of the call, where the ABI put it.
    let arg = |i: usize| unsafe {
        if i < 6 {
            *regs.add(i)
        } else {
            *stack.add(i - 6)
        }
    };
    let path = arg(0) as *const c_char;
    let mut argv: Vec<*const c_char> = Vec::new();
    let mut i = 1;
    loop {
        let a = arg(i) as *const c_char;
        argv.push(a);
        i += 1;
        if a.is_null() {
            break;
        }
    }
    // SAFETY: forwarded to the interposed list-less forms.
    unsafe {
        match kind {
            0 => execv(path, argv.as_ptr()),
            1 => execvp(path, argv.as_ptr()),
            _ => execve(path, argv.as_ptr(), arg(i) as *const *const c_char),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_reject_garbage() {
        let r = Record {
            ino: 12345,
            side: 1,
            ring: 262144,
            memfd: 7,
            my_efd: 8,
            peer_efd: 9,
            hup: 10,
            shut: 2,
            pair: None,
        };
        assert_eq!(Record::parse(&r.encode()), Some(r));
        for bad in [
            "",
            "1:2:3",
            "1:2:262144:7:8:9:10:0",
            "1:0:0:7:8:9:10:0",
            "x:0:4096:7:8:9:10:0",
            "1:0:4096:-1:8:9:10:0",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad}");
        }
    }
}
