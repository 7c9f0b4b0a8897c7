//! `STRAIT_STATS=1`: one line on stderr at exit with this process's counts: TCP
//! connections accelerated / fallen back to the kernel / attached by path B; UDP
//! channels set up as sender (`udp-out`) and receiver (`udp-in`), datagrams sent and
//! received through shared memory, datagrams dropped because a receiver's ring was
//! full (counted by the sender, as a kernel counts receive-buffer errors); TCP
//! connections to other hosts carried by strait (`remote`), of them by the xdp device
//! (`remote-xdp`); connections taken over from the program that exec'd this one or
//! the process that spawned it (`inherited`); messages (message mode) copied straight
//! into a waiting reader's buffer (`rendezvous`), of them split with the reader,
//! which read a part from this process's buffer (`rendezvous-split`); rendezvous
//! partners refused
//! because they could not be proven (`refused`: a name held by another user, a
//! token naming another socket, a doorbell that is not an eventfd; see
//! docs/SECURITY.md); connections to other hosts refused for a secret that differs
//! (`remote-refused`); discovery messages and answers ignored as forged or replayed
//! (`remote-forged`); accelerated connections passed to another process over a
//! Unix socket (`pass-out`) and taken over from one (`pass-in`); whether this
//! process was made without fork handlers (a raw `clone`) and noticed by the fork
//! watch (`unseen-forks`); what the library holds for itself at exit and at most
//! (`lib-fds`, `lib-fds-peak`: its own descriptors; `shm-bytes`, `shm-bytes-peak`:
//! shared memory mapped for rings); the vault of connections' memfds
//! (`vault-rings`: io_uring vault rings this process made, 0 when each connection
//! keeps a socketpair instead; `vault-live`, `vault-dead`: slots of connections
//! held, and of closed ones awaiting the next rotation; `vault-watches`: rotated-out
//! rings whose teardown is still awaited, a descriptor each for a few milliseconds,
//! counted in `lib-fds`); the doorbells of process
//! pairs (`pairs`: pairs held, two eventfds each; `pair-conns`: connections that
//! ring through them; `hubs`: threads' epoll instances for pair bells);
//! connections this process left on the kernel path because its connections to
//! the same listener were too short to pay for the setup (`kernel-short`, see
//! `worth.rs`); accepted connections whose connectors were asked for their hello
//! directly (`path-b-asks`, answered or not); accepted connections whose far end
//! was looked up to match a queued hello (`far-end-looks`).

use std::sync::atomic::Ordering;

use crate::conn::{ACCELERATED, KERNEL_FALLBACKS, PATH_B, REMOTE, REMOTE_XDP};
use crate::udp;

extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        // (The census first: it lets go of finished teardown watches.)
        let vault = crate::vault::census();
        let held = crate::fds::held();
        let (pairs, pair_conns) = crate::pair::census();
        let line = format!(
            "strait-preload: pid {} accelerated {} kernel-fallback {} path-b {} \
             udp-out {} udp-in {} udp-sent {} udp-received {} udp-dropped {} remote {} remote-xdp {} inherited {} rendezvous {} rendezvous-split {} \
             refused {} remote-refused {} remote-forged {} pass-out {} pass-in {} unseen-forks {} \
             lib-fds {} lib-fds-peak {} shm-bytes {} shm-bytes-peak {} vault-rings {} vault-live {} vault-dead {} vault-watches {} \
             pairs {} pair-conns {} hubs {} kernel-short {} path-b-asks {} far-end-looks {}\n",
            std::process::id(),
            ACCELERATED.load(Ordering::Relaxed),
            KERNEL_FALLBACKS.load(Ordering::Relaxed),
            PATH_B.load(Ordering::Relaxed),
            udp::OUT_CHANNELS.load(Ordering::Relaxed),
            udp::IN_CHANNELS.load(Ordering::Relaxed),
            udp::SENT.load(Ordering::Relaxed),
            udp::RECEIVED.load(Ordering::Relaxed),
            udp::DROPPED.load(Ordering::Relaxed),
            REMOTE.load(Ordering::Relaxed),
            REMOTE_XDP.load(Ordering::Relaxed),
            crate::exec::INHERITED.load(Ordering::Relaxed),
            crate::conn::RENDEZVOUS.load(Ordering::Relaxed),
            crate::conn::SPLITS.load(Ordering::Relaxed),
            crate::trust::REFUSED.load(Ordering::Relaxed),
            crate::conn::REMOTE_REFUSED.load(Ordering::Relaxed),
            crate::conn::REMOTE_FORGED.load(Ordering::Relaxed),
            crate::pass::PASSED_OUT.load(Ordering::Relaxed),
            crate::pass::PASSED_IN.load(Ordering::Relaxed),
            crate::process::UNSEEN_FORKS.load(Ordering::Relaxed),
            held.fds,
            held.fds_peak,
            held.shm_bytes,
            held.shm_peak,
            vault.2,
            vault.0,
            vault.1,
            vault.3,
            pairs,
            pair_conns,
            crate::hub::count(),
            crate::worth::KERNEL_SHORT.load(Ordering::Relaxed),
            crate::discover::PATH_B_ASKS.load(Ordering::Relaxed),
            crate::discover::FAR_END_LOOKS.load(Ordering::Relaxed),
        );
        // SAFETY: writes a local buffer to stderr.
        unsafe { crate::real::write(2, line.as_ptr().cast(), line.len()) };
    });
}

/// Called once at load time.
pub fn init() {
    if std::env::var_os("STRAIT_STATS").is_some_and(|v| !v.is_empty() && v != "0") {
        // SAFETY: registers a plain extern "C" function.
        unsafe { libc::atexit(at_exit) };
    }
}
