//! Accelerated sockets passed to another process over a Unix socket (`SCM_RIGHTS`):
//! socket activation, seamless reloads and privilege-separation helpers hand
//! sockets around this way.
//!
//! An accelerated TCP socket is an idle kernel socket plus rings in shared memory.
//! Passing only the kernel socket would leave the receiver reading a socket that
//! never gets a byte. So when a program sends an accelerated socket, the library
//! adds one descriptor to the message: a *bundle*, a Unix socket holding in flight
//! one message that describes each passed connection (the records of `exec.rs`,
//! with descriptor indices) and carries copies of what carries it (the rings'
//! memfd, both eventfds, and a connection to another host's liveness socket; the
//! passed TCP socket itself tells of a local peer's hang-up). The library of the receiving
//! process takes the bundle off the message before the program sees it, maps the
//! rings and enters the received descriptors as the connection. The receiver takes
//! a hold on the connection (counted for it by the sender), so the sender may
//! close its copy at once.
//!
//! A receiver without the library would see the bundle as one more descriptor, and
//! read an idle socket: both ends run under `strait run` (its children inherit it).
//!
//! A passed listening socket takes its rendezvous name's socket along (the
//! receiver gets the hellos at once, as forked workers share them); one without a
//! name is registered at the first `accept` and claims connections by asking their
//! connectors (path B). A passed UDP socket receives through the kernel from then
//! on (its shared-memory channels belong to the sender's library; senders go back
//! to the kernel, and what they had already put in the channels is read by the
//! sender's process).
//!
//! Trust: the bundle comes from the process that sent the socket, which held the
//! connection and so could read and write it anyway; the receiver checks every
//! carrier as an `exec`'d program does (a sealed memfd of the right size, a ring
//! header of ours, a socket whose inode the record names).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use libc::{c_int, msghdr};

use crate::conn::Conn;
use crate::exec::{adopt_one, inode, record_for, Record};
use crate::sock::{close_all, recv_fds_max, send_fds};
use crate::{real, table};

/// First bytes of a bundle's message.
const MAGIC: &[u8; 8] = b"STRAITPS";
/// Connections one message may pass with the library's help (each takes four
/// descriptors in the bundle).
const MAX_CONNS: usize = 16;

/// Passed accelerated connections taken over by this process (`pass-in`), and
/// handed to another (`pass-out`).
pub static PASSED_IN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// See [`PASSED_IN`].
pub static PASSED_OUT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The descriptors of every SCM_RIGHTS control message of `msg`.
///
/// # Safety
/// `msg` is a valid msghdr whose control buffer holds `msg_controllen` bytes.
unsafe fn rights(msg: *const msghdr) -> Vec<c_int> {
    let mut out = Vec::new();
    // SAFETY: per the caller; the CMSG macros stay within msg_controllen.
    unsafe {
        if (*msg).msg_control.is_null() || (*msg).msg_controllen == 0 {
            return out;
        }
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<c_int>();
                let n = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..n {
                    out.push(std::ptr::read_unaligned(data.add(i)));
                }
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    out
}

/// `sendmsg` on a socket the library does not carry: if the message passes
/// accelerated connections, sends it with a bundle added and returns the result;
/// `None` if there is nothing to add (the caller sends it as it is).
///
/// # Safety
/// `msg` is a valid msghdr.
pub unsafe fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> Option<isize> {
    if !table::any_live() && !crate::table::any_listening() && !crate::table::any_udp() {
        return None;
    }
    // SAFETY: per the caller.
    let passed = unsafe { rights(msg) };
    // A UDP socket's shared-memory channels stay with this process's library:
    // from now on it receives through the kernel, which both processes read.
    for &f in &passed {
        if let Some(u) = crate::table::udp(f) {
            u.receive_through_kernel();
        }
    }
    let mut conns: Vec<(c_int, Arc<Conn>)> = Vec::new();
    for f in passed {
        if let Some(c) = crate::settle::accel(f) {
            if c.vault.is_some() && c.attached() && !conns.iter().any(|(_, x)| Arc::ptr_eq(x, &c)) {
                conns.push((f, c));
            }
        }
    }
    // Listening sockets we hold the rendezvous name of: the name's socket goes
    // along, so that the receiver gets the hellos at once (as forked workers
    // share it), whether or not this process stays.
    let mut listeners: Vec<(u64, c_int)> = Vec::new();
    // SAFETY: per the caller.
    for f in unsafe { rights(msg) } {
        if let (Some(l), Some(ino)) = (crate::discover::listener(f), inode(f)) {
            if let Some(m) = l.marker() {
                listeners.push((ino, m));
                // The receiver may take hellos of our accepts from now on.
                l.shared.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
    if conns.is_empty() && listeners.is_empty() {
        return None;
    }
    conns.truncate(MAX_CONNS);
    listeners.truncate(MAX_CONNS);
    let mut records = Vec::new();
    let mut copies: Vec<c_int> = Vec::new();
    for (ino, m) in &listeners {
        // SAFETY: plain syscall (a copy to send; closed below like the others).
        let d = unsafe { real::fcntl(*m, libc::F_DUPFD_CLOEXEC, 0) };
        if d >= 0 {
            records.push(format!("L{ino}:{}", copies.len()));
            copies.push(d);
        }
    }
    for (f, c) in &conns {
        // The receiver holds the connection's pair beside us.
        let Some((mut r, cs)) = record_for(*f, c, true) else { continue };
        // Descriptor fields become indices into the bundle's descriptors.
        let base = copies.len() as c_int;
        let index = |fd: c_int| cs.iter().position(|&x| x == fd).map_or(-1, |i| base + i as c_int);
        (r.memfd, r.my_efd, r.peer_efd, r.hup) =
            (index(r.memfd), index(r.my_efd), index(r.peer_efd), index(r.hup));
        if let Some(p) = r.pair.as_mut() {
            p.memfd = index(p.memfd);
        }
        records.push(r.encode());
        copies.extend_from_slice(&cs);
    }
    if records.is_empty() {
        return None;
    }
    let mut sp = [-1; 2];
    // SAFETY: socketpair writes two descriptors into `sp`.
    if unsafe {
        libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, sp.as_mut_ptr())
    } != 0
    {
        close_all(&copies);
        return None;
    }
    let mut text = MAGIC.to_vec();
    text.extend_from_slice(records.join(",").as_bytes());
    let loaded = send_fds(sp[1], &text, &copies);
    close_all(&copies);
    close_all(&[sp[1]]);
    if !loaded {
        close_all(&[sp[0]]);
        return None;
    }
    // The program's control messages, then one more SCM_RIGHTS with the bundle
    // (the kernel hands all passed descriptors over in one message, in order).
    // SAFETY: per the caller.
    let (old_ctl, old_len) = unsafe { ((*msg).msg_control.cast::<u8>(), (*msg).msg_controllen) };
    // SAFETY: CMSG_SPACE is a pure computation.
    let extra = unsafe { libc::CMSG_SPACE(4) } as usize;
    let mut ctl = vec![0u64; (old_len + extra).div_ceil(8)];
    // SAFETY: copies the caller's control bytes into a buffer at least as large.
    unsafe { std::ptr::copy_nonoverlapping(old_ctl, ctl.as_mut_ptr().cast::<u8>(), old_len) };
    // SAFETY: msghdr is plain old data; a copy of the caller's with our control.
    let mut m: msghdr = unsafe { *msg };
    m.msg_control = ctl.as_mut_ptr().cast();
    m.msg_controllen = (old_len + extra) as _;
    // SAFETY: the new cmsg header starts at the (aligned) end of the program's
    // control data and fits in `extra` bytes.
    unsafe {
        let c = ctl.as_mut_ptr().cast::<u8>().add(old_len).cast::<libc::cmsghdr>();
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<c_int>(), sp[0]);
    }
    // The receiver will hold each connection: counted before it can let go.
    for (_, c) in &conns {
        c.add_holder();
    }
    // SAFETY: a complete msghdr pointing at the caller's data and our control.
    let n = unsafe { real::sendmsg(fd, &m, flags) };
    close_all(&[sp[0]]);
    if n < 0 {
        let e = real::errno();
        for (_, c) in &conns {
            c.drop_holder();
        }
        real::set_errno(e);
    } else {
        PASSED_OUT.fetch_add(conns.len(), Ordering::Relaxed);
    }
    Some(n)
}

/// After a `recvmsg` on a socket the library does not carry: takes a bundle off
/// the received descriptors (the last one, if it is ours) and takes over the
/// connections it describes.
///
/// # Safety
/// `msg` is the msghdr a successful `recvmsg` just filled.
pub unsafe fn after_recvmsg(msg: *mut msghdr) {
    // SAFETY: per the caller.
    unsafe {
        if msg.is_null() || (*msg).msg_control.is_null() || (*msg).msg_controllen == 0 {
            return;
        }
        // The last SCM_RIGHTS message and its last descriptor.
        let mut last: *mut libc::cmsghdr = std::ptr::null_mut();
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                last = c;
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
        if last.is_null() {
            return;
        }
        let n = ((*last).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize) / 4;
        if n == 0 {
            return;
        }
        let data = libc::CMSG_DATA(last).cast::<c_int>();
        let bundle = std::ptr::read_unaligned(data.add(n - 1));
        let Some(Bundle { records, markers, fds }) = open_bundle(bundle) else {
            // No bundle: a listening socket among them is registered at once all
            // the same, so that connections arriving before its first accept are
            // claimed too.
            for i in 0..n {
                crate::discover::adopt_listener(std::ptr::read_unaligned(data.add(i)));
            }
            return;
        };
        // Ours: the program never sees it.
        close_all(&[bundle]);
        (*last).cmsg_len = libc::CMSG_LEN(((n - 1) * 4) as u32) as _;
        let end =
            (last as usize - (*msg).msg_control as usize) + libc::CMSG_SPACE(((n - 1) * 4) as u32) as usize;
        (*msg).msg_controllen = end.min((*msg).msg_controllen) as _;
        let passed: Vec<(c_int, u64)> = (0..n - 1)
            .map(|i| std::ptr::read_unaligned(data.add(i)))
            .filter_map(|f: c_int| Some((f, inode(f)?)))
            .collect();
        // Listeners with the name's socket that came along; then any other.
        let mut used = vec![false; fds.len()];
        for (ino, i) in markers {
            if let (Some(&(f, _)), Some(&m)) = (passed.iter().find(|p| p.1 == ino), fds.get(i)) {
                if !used[i] {
                    used[i] = true;
                    crate::discover::register_listener(f, Some(m));
                }
            }
        }
        for &(f, _) in &passed {
            crate::discover::adopt_listener(f);
        }
        let rest: Vec<c_int> = fds.iter().enumerate().map(|(i, &f)| if used[i] { -1 } else { f }).collect();
        adopt(records, rest, &passed);
    }
}

/// What `fd` carries if it is a bundle (a seqpacket Unix socket holding one
/// message that starts with [`MAGIC`]); `None` leaves it untouched.
fn open_bundle(fd: c_int) -> Option<Bundle> {
    let get = |opt| crate::sock::socket_option(fd, opt);
    if get(libc::SO_DOMAIN) != Some(libc::AF_UNIX) || get(libc::SO_TYPE) != Some(libc::SOCK_SEQPACKET) {
        return None;
    }
    let mut head = [0u8; 8];
    // SAFETY: peeks into a local buffer without waiting.
    let n = unsafe { real::recv(fd, head.as_mut_ptr().cast(), 8, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n != 8 || &head != MAGIC {
        return None;
    }
    let mut buf = vec![0u8; 64 * MAX_CONNS + 8];
    let m = recv_fds_max(fd, &mut buf, libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC, 4 * MAX_CONNS).ok()?;
    if m.truncated || m.len < 8 {
        close_all(&m.fds);
        return Some(Bundle { records: Vec::new(), markers: Vec::new(), fds: Vec::new() });
    }
    let text = String::from_utf8_lossy(&buf[8..m.len]).to_string();
    let mut records = Vec::new();
    let mut markers = Vec::new();
    for r in text.split(',') {
        match r.strip_prefix('L') {
            Some(l) => {
                let mut f = l.split(':');
                if let (Some(Ok(ino)), Some(Ok(i))) =
                    (f.next().map(str::parse::<u64>), f.next().map(str::parse::<usize>))
                {
                    markers.push((ino, i));
                }
            }
            None => records.extend(Record::parse(r)),
        }
    }
    Some(Bundle { records, markers, fds: m.fds })
}

/// What a bundle carries: connections, listeners' rendezvous names (inode of the
/// listening socket, index of the name's socket), and the descriptors.
struct Bundle {
    records: Vec<Record>,
    markers: Vec<(u64, usize)>,
    fds: Vec<c_int>,
}

/// Takes over each record's connection for the received descriptors `passed`
/// (descriptor, inode); closes every carrier not used.
fn adopt(records: Vec<Record>, fds: Vec<c_int>, passed: &[(c_int, u64)]) {
    let mut used: Vec<bool> = fds.iter().map(|&f| f < 0).collect();
    for mut r in records {
        let mut idx = vec![r.memfd, r.my_efd, r.peer_efd];
        if r.hup != -1 {
            idx.push(r.hup);
        }
        if let Some(p) = r.pair {
            idx.push(p.memfd);
        }
        if idx.iter().any(|&i| i < 0 || i as usize >= fds.len() || used[i as usize]) {
            continue;
        }
        for &i in &idx {
            used[i as usize] = true;
        }
        let at = |i: c_int| if i < 0 { -1 } else { fds[i as usize] };
        (r.memfd, r.my_efd, r.peer_efd, r.hup) = (at(r.memfd), at(r.my_efd), at(r.peer_efd), at(r.hup));
        if let Some(p) = r.pair.as_mut() {
            p.memfd = at(p.memfd);
        }
        let mine: Vec<(c_int, u64)> = passed.iter().copied().filter(|p| p.1 == r.ino).collect();
        if mine.is_empty() || !crate::sock::memfd_ok(r.memfd, crate::conn::HDR + 2 * r.ring) {
            // Not taken: the hold the sender took for us ends with these copies
            // (the liveness socket's copy closes with them).
            close_all(
                &[r.memfd, r.my_efd, r.peer_efd, r.hup, r.pair.map_or(-1, |p| p.memfd)]
                    .into_iter()
                    .filter(|&f| f >= 0)
                    .collect::<Vec<_>>(),
            );
            continue;
        }
        // (Past the memfd check, adopt_one closes what it does not keep.)
        if adopt_one(r, &mine) {
            PASSED_IN.fetch_add(1, Ordering::Relaxed);
        }
    }
    for (i, &f) in fds.iter().enumerate() {
        if !used[i] && f >= 0 {
            close_all(&[f]);
        }
    }
}
