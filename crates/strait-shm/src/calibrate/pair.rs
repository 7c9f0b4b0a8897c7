//! The three rendezvous paths timed between two processes, as the shm device runs
//! them: this process is the receiver, a helper process made for the measurement is
//! the sender. Timing them between two threads of one process misled: on the 2-core
//! Intel Xeon VM the threads measured the pipelined copy at 15-16 GB/s and the split
//! at 9-12 GB/s, where two processes streaming 1 MiB messages (`strait bench`) ran
//! the copy at 9.4 GB/s and the split at 20 GB/s (the two `process_vm_*` calls of
//! one process contend on one address space).
//!
//! The helper is made with a raw `clone` (no fork handlers of the program or of
//! strait's preload run, no `SIGCHLD` reaches the program, and the descriptor table
//! is shared rather than copied, so no file of the program stays open because of
//! it), touches nothing but
//! its own copy of the message, a shared mapping of control words and the copy
//! path's ring, and makes no call that takes a lock or allocates: it spins on the
//! control words, copies, calls `process_vm_writev`, and `_exit`s. Every wait on
//! either side is bounded; a helper that stops answering is killed and its paths
//! count as not measured.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use strait_sys::Mapping;

use super::{fill, gbps, CHUNK, MSG, RUN, SLOTS};

/// What the helper does in a round.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(super) enum Path {
    /// Copies the message into the ring chunk by chunk.
    Copy = 1,
    /// Nothing: the receiver reads the whole message.
    RemoteRead = 2,
    /// Writes the message's second half into the receiver's buffer.
    Split = 3,
    /// Leaves.
    Exit = 4,
}

/// Control words, each on its own cache line, at these offsets of the shared page.
const KIND: usize = 0;
/// Round r (from 1) starts: the receiver published `KIND` and reset the chunk counts.
const START: usize = 64;
/// The helper wrote round r's message.
const FILLED: usize = 128;
/// The receiver's clock runs: the helper does its part of round r.
const GO: usize = 192;
/// The helper's part of round r is done (`u64::MAX`: it failed).
const WROTE: usize = 256;
/// The receiver is done with round r: the helper may write the next message.
const ACK: usize = 320;
/// Copy path: chunks the helper put into the ring, and chunks the receiver took.
const PRODUCED: usize = 384;
const CONSUMED: usize = 448;
/// The ring follows the control page.
const RING_AT: usize = 4096;

/// How long either side waits for the other before it gives up.
const PATIENCE: Duration = Duration::from_secs(2);

/// The shared mapping's words and ring; the helper and this process see the same
/// pages.
struct Shared {
    map: Mapping,
}

impl Shared {
    fn word(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the offsets above, 8-byte aligned inside the first
        // page of the mapping, which lives as long as `self`; both processes access
        // the words only atomically.
        unsafe { &*self.map.ptr().add(at).cast::<AtomicU64>() }
    }

    fn slot(&self, i: usize) -> *mut u8 {
        // SAFETY: slot `i % SLOTS` lies inside the ring after the control page.
        unsafe { self.map.ptr().add(RING_AT + (i % SLOTS) * CHUNK) }
    }

    /// Spins until `word` reaches `at_least`; false after [`PATIENCE`] or if it
    /// reads `u64::MAX` (the other side failed).
    fn wait(&self, word: usize, at_least: u64) -> bool {
        let mut start: Option<Instant> = None;
        let mut spins = 0u32;
        loop {
            let v = self.word(word).load(Ordering::Acquire);
            if v == u64::MAX {
                return false;
            }
            if v >= at_least {
                return true;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) && start.get_or_insert_with(Instant::now).elapsed() > PATIENCE {
                return false;
            }
            std::hint::spin_loop();
        }
    }
}

/// The helper process, reaped (killed first if it is still there) when dropped.
struct Helper {
    pid: libc::pid_t,
}

impl Drop for Helper {
    fn drop(&mut self) {
        let mut status = 0;
        for _ in 0..200 {
            // SAFETY: waits for our own child, made with no exit signal (__WALL).
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG | libc::__WALL) };
            if r != 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: our own child, which has not been reaped.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, &mut status, libc::__WALL);
        }
    }
}

/// The helper's whole life: per round, write the message, wait for the go, do its
/// part, wait for the receiver to finish. Nothing here allocates or takes a lock.
fn helper(shared: &Shared, src: *mut u8, dst: *mut u8, parent: libc::pid_t, tx_cpu: Option<usize>) -> ! {
    // SAFETY: prctl makes this process die with its parent thread; plain syscall.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    if let Some(c) = tx_cpu {
        strait_sys::cpu::pin(c);
    }
    let cut = MSG / 2;
    let mut r = 1u64;
    loop {
        if !shared.wait(START, r) {
            break;
        }
        let kind = shared.word(KIND).load(Ordering::Acquire);
        if kind == Path::Exit as u64 {
            break;
        }
        // SAFETY: `src` is this process's own copy of the message buffer (MSG bytes).
        fill(unsafe { std::slice::from_raw_parts_mut(src, MSG) }, r as usize);
        shared.word(FILLED).store(r, Ordering::Release);
        if !shared.wait(GO, r) {
            break;
        }
        let ok = if kind == Path::Copy as u64 {
            let per_msg = MSG / CHUNK;
            let mut ok = true;
            for i in 0..per_msg {
                if !shared.wait(CONSUMED, (i + 1).saturating_sub(SLOTS) as u64) {
                    ok = false;
                    break;
                }
                // SAFETY: chunk `i` of the message is inside `src`; the slot is inside
                // the ring, free (the receiver consumed i - SLOTS), and only this side
                // writes it until it is published.
                unsafe { std::ptr::copy_nonoverlapping(src.add(i * CHUNK), shared.slot(i), CHUNK) };
                shared.word(PRODUCED).store(i as u64 + 1, Ordering::Release);
            }
            ok
        } else if kind == Path::Split as u64 {
            // SAFETY: the second halves of `src` (ours) and of the receiver's `dst`
            // (the same address in the parent) are this side's part alone.
            unsafe { super::super::sys::vm_write(parent, dst.add(cut) as u64, src.add(cut), MSG - cut) }
                .is_ok()
        } else {
            true
        };
        // A failed part (a refused `process_vm_writev`) fails this round only: the
        // receiver resets the word before the next.
        shared.word(WROTE).store(if ok { r } else { u64::MAX }, Ordering::Release);
        if !shared.wait(ACK, r) {
            break;
        }
        r += 1;
    }
    // SAFETY: leaves at once, running no exit handlers of the program.
    unsafe { libc::_exit(0) }
}

/// Best of `runs` runs of each path, GB/s, in the order copy, remote read, split
/// (0 where a path could not run); `None` if no helper process could be made.
pub(super) fn measure(runs: usize, tx_cpu: Option<usize>) -> Option<(f64, f64, f64)> {
    let shared = Shared { map: Mapping::anonymous_shared(RING_AT + SLOTS * CHUNK).ok()? };
    let src_map = Mapping::anonymous(MSG).ok()?;
    let dst_map = Mapping::anonymous(MSG).ok()?;
    let (src, dst) = (src_map.ptr(), dst_map.ptr());
    // Touched now, so that no page fault lands in a measurement (the helper's copy
    // of `src` faults in its first, untimed, fill).
    // SAFETY: both mappings are MSG bytes, private to this process until the clone.
    unsafe {
        std::ptr::write_bytes(src, 1, MSG);
        std::ptr::write_bytes(dst, 0, MSG);
    }
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: a raw clone without CLONE_VM is a fork that runs no fork handlers and,
    // with no exit signal, sends the program no SIGCHLD; CLONE_FILES shares the
    // descriptor table instead of copying it, so the helper holds no extra reference
    // to any of the program's files (a pipe the program closes meanwhile still ends
    // at once for its reader). The child runs only `helper`, which uses no
    // descriptor and never returns.
    let flags = libc::CLONE_FILES as libc::c_ulong;
    let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    if pid < 0 {
        return None;
    }
    if pid == 0 {
        helper(&shared, src, dst, parent, tx_cpu);
    }
    let helper_proc = Helper { pid: pid as libc::pid_t };
    let mut round = 0u64;
    let mut best = [0.0f64; 3];
    let mut failed = [false; 3];
    'paths: for _ in 0..runs {
        for (k, path) in [Path::Copy, Path::RemoteRead, Path::Split].into_iter().enumerate() {
            if failed[k] {
                continue;
            }
            match run(&shared, path, &mut round, src, dst, helper_proc.pid) {
                Ok(g) => best[k] = best[k].max(g),
                // A path that failed (a refused `process_vm_*`) counts 0 and is not
                // tried again.
                Err(Failure::Path) => {
                    failed[k] = true;
                    best[k] = 0.0;
                }
                // A helper that stopped answering ends the measurement.
                Err(Failure::Helper) => break 'paths,
            }
        }
    }
    shared.word(KIND).store(Path::Exit as u64, Ordering::Release);
    shared.word(START).store(round + 1, Ordering::Release);
    drop(helper_proc);
    Some((best[0], best[1], best[2]))
}

/// The byte [`fill`] writes for round `r`.
fn fill_value(r: u64) -> u8 {
    r as u8 | 1
}

/// Why a run ended without a figure.
enum Failure {
    /// The path's system call was refused or failed (on either side).
    Path,
    /// The helper did not answer in time.
    Helper,
}

/// One run of `path`: [`RUN`] bytes in [`MSG`]-byte messages, the clock running
/// only while a message moves. GB/s.
fn run(
    shared: &Shared,
    path: Path,
    round: &mut u64,
    src: *mut u8,
    dst: *mut u8,
    pid: libc::pid_t,
) -> Result<f64, Failure> {
    let cut = MSG / 2;
    let mut secs = 0.0;
    for _ in 0..RUN / MSG {
        *round += 1;
        let r = *round;
        shared.word(KIND).store(path as u64, Ordering::Relaxed);
        shared.word(PRODUCED).store(0, Ordering::Relaxed);
        shared.word(CONSUMED).store(0, Ordering::Relaxed);
        shared.word(WROTE).store(0, Ordering::Relaxed);
        shared.word(START).store(r, Ordering::Release);
        if !shared.wait(FILLED, r) {
            return Err(Failure::Helper);
        }
        let t = Instant::now();
        shared.word(GO).store(r, Ordering::Release);
        let ok = match path {
            Path::Copy => {
                let mut ok = true;
                for i in 0..MSG / CHUNK {
                    if !shared.wait(PRODUCED, i as u64 + 1) {
                        ok = false;
                        break;
                    }
                    // SAFETY: the helper published slot `i` and leaves it alone until
                    // it is handed back; chunk `i` lies inside `dst`.
                    unsafe { std::ptr::copy_nonoverlapping(shared.slot(i), dst.add(i * CHUNK), CHUNK) };
                    shared.word(CONSUMED).store(i as u64 + 1, Ordering::Release);
                }
                ok
            }
            // SAFETY: `dst` is MSG bytes of ours; `src` is the same address in the
            // helper, which does not write it before our ACK.
            Path::RemoteRead => unsafe { super::super::sys::vm_read(pid, src as u64, dst, MSG) }.is_ok(),
            // SAFETY: the first half of `dst` is ours alone; the helper writes the second.
            Path::Split => unsafe { super::super::sys::vm_read(pid, src as u64, dst, cut) }.is_ok(),
            Path::Exit => false,
        };
        let theirs = shared.wait(WROTE, r);
        secs += t.elapsed().as_secs_f64();
        let refused = shared.word(WROTE).load(Ordering::Acquire) == u64::MAX;
        shared.word(ACK).store(r, Ordering::Release);
        // The message arrived whole: its first and last bytes and both sides of the
        // cut hold this round's value (a path that moved nothing would time well).
        let want = fill_value(r);
        // SAFETY: the four offsets lie inside `dst` (MSG bytes of ours); the helper
        // wrote nothing into it since its WROTE.
        let arrived =
            [0, cut - 1, cut, MSG - 1].iter().all(|&i| unsafe { dst.add(i).read_volatile() } == want);
        if refused || (theirs && !(ok && arrived)) {
            // A system call of the path was refused, on either side.
            return Err(Failure::Path);
        }
        if !theirs {
            return Err(Failure::Helper);
        }
    }
    gbps(RUN, secs).ok_or(Failure::Path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The helper process runs every path with this one, and each moves the bytes
    /// (the run checks them) in measurable time.
    #[test]
    fn two_processes_time_every_path() {
        let (copy, remote, split) = measure(1, None).expect("no helper process could be made");
        assert!(copy > 0.0, "copy path");
        // Remote reads and writes need ptrace rights over the helper, which a
        // process has over its own child unless a security module says otherwise.
        assert!(remote > 0.0 && split > 0.0, "remote read {remote}, split {split}");
    }
}
